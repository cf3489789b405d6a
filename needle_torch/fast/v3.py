"""Needle 3's cached decoding steps through torch.compile (inductor's graphs, the library's matmul kernels; no C++).

`compiled_step(model)` is `needle_torch.v3.generate.decode_step` for one-token steps, each layer a compiled graph, and
`generate` is `needle_torch.v3.generate.generate`'s loop with it (the prefill stays the plain step: it runs once a
request, its shapes change with every prompt length). The graph is built from the plain step's own pieces
(`_attention_step`, `_lane_offsets`, `_engram_step`, the model's submodules), with two things moved so that dynamo
traces each layer as one graph, without breaks or per-step recompiles:
- the engram's (key, value) come from the plain `_engram_step`, run eagerly before the graph (it turns the position
  into a Python slice); the graph takes them as inputs, and the position as a tensor;
- the Monarch MLP's two fixed permutations, which `HadamardMLP.forward` draws from numpy's RandomState (untraceable),
  are made once per model as tensors; `_hadamard_mlp` is that forward with them, and `_block_step`, `_layer_step`
  the plain ones calling it (the same operations in the same order, so the same roundings). The plain step
  could be compiled whole if the model kept them as tensors and `_engram_step` sliced with a tensor index.
(Traced whole, the plain step breaks its graph at both, and under inference_mode dynamo's guard on the numpy-made
tensors fails outright on torch 2.13: "dispatch key set mismatch".) Each layer's few-row products are written as
kernels.Linear writes them (_FewRowProducts).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from convert.v3.config import EOS_ID, PAD_ID, hada_perms
from needle_torch.fast.kernels import CompiledStep, as_reduction, matmul_nt
from needle_torch.v2.generate import Streamer, _loop, pick
from needle_torch.v2.lanes import rms_unit, sinkhorn
from needle_torch.v3.generate import (
    DecodeCache,
    _attention_step,
    _engram_step,
    _lane_offsets,
    _prepare,
    decode_step,
    new_cache,
)
from needle_torch.v3.model import _sigmoid, _softmax, kron_apply


def _hadamard_mlp(mlp: nn.Module, x: Tensor, p1: Tensor, p2: Tensor) -> Tensor:
    """HadamardMLP.forward with its permutations p1, p2 given as tensors: x (B, S, D) in dt -> (B, S, D)."""
    dt, P = mlp.compute_dtype, mlp.d1.shape[0]
    w = {name: getattr(mlp, name).to(dt) for name in ("w1a", "w1b", "w2a", "w2b", "w3a", "w3b")}
    d1, d2, b2, d3, d4 = (t.to(dt) for t in (mlp.d1, mlp.d2, mlp.b2, mlp.d3, mlp.d4))
    cond = 1 + mlp.cond_u(_softmax(mlp.cond_v(x)))  # (B, S, P), from the unpadded x
    z = F.pad(x, (0, P - mlp.d_model))  # (B, S, P)
    z = kron_apply(d1 * z, w["w1a"], w["w1b"])[..., p1]
    z = d2 * cond * z + b2
    z = kron_apply(z * _sigmoid(z), w["w2a"], w["w2b"])[..., p2]  # jax.nn.silu: x·σ(x), two roundings
    z = kron_apply(d3 * z, w["w3a"], w["w3b"])
    return (d4 * z)[..., :mlp.d_model]  # (B, S, D)


def _block_step(block: nn.Module, x: Tensor, attention, engram_kv, site_flags: Tensor, perms) -> Tensor:
    """plain._block_step with _hadamard_mlp."""
    if engram_kv is not None:
        ek, ev = engram_kv
        alpha = torch.sigmoid(torch.einsum("btd,sbtd->sbt", rms_unit(x), rms_unit(ek)) / math.sqrt(x.shape[-1]))
        x = x + torch.einsum("s,sbt,sbtd->btd", site_flags, alpha, ev.float()).to(x.dtype)  # (B, S, D)
    skip = x
    x = attention(block.pre_attn_norm(x))
    x = skip + _sigmoid(block.attn_gate).to(block.compute_dtype) * block.post_attn_norm(x)
    return x + _hadamard_mlp(block.hadamard_mlp, block.pre_hada_norm(x), *perms)


def _layer_step(layer: nn.Module, lanes: Tensor, offsets, attention, engram_kv, site_flags: Tensor, perms) -> Tensor:
    """plain._layer_step with this file's _block_step: lanes (B, S, n, D) in dt -> the new lanes."""
    B, S, n, D = lanes.shape
    pre_off, post_off = offsets
    xf = lanes.float()
    nx = rms_unit(lanes.reshape(B, S, n * D))  # (B, S, n·D) float32
    hpre = torch.sigmoid(layer.a_pre * F.linear(nx, layer.phi_pre.weight.float()) + layer.b_pre + pre_off)
    u = torch.einsum("btn,btnc->btc", hpre, xf).to(layer.compute_dtype)  # (B, S, D)
    y = _block_step(layer.block, u, attention, engram_kv, site_flags, perms) - u
    hpost = 2 * torch.sigmoid(layer.a_post * F.linear(nx, layer.phi_post.weight.float()) + layer.b_post + post_off)
    res = F.linear(nx, layer.phi_res.weight.float())  # (B, S, n·n)
    hres = sinkhorn(layer.a_res * res.reshape(B, S, n, n) + layer.b_res)  # (B, S, n, n)
    return (torch.einsum("btij,btjc->btic", hres, xf)
            + hpost[..., None] * y.float()[:, :, None, :]).to(layer.compute_dtype)  # (B, S, n, D)


class _FewRowProducts(TorchFunctionMode):
    """Inside a compiled CPU graph, F.linear with few rows (kernels.REDUCE_MAX_ROWS) as kernels.Linear writes it: a
    float32 multiply-and-sum rounded once to x's dtype, which inductor fuses into passes reading each weight once in
    its own dtype (torch's bf16 matrix-vector products were slower than its float32 ones here). The same function up
    to the order of the float32 sum; every other call runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) == 2 and not kwargs:
            x, w = args
            if as_reduction(x.shape[:-1].numel(), x.device):
                return matmul_nt(x[..., None, :], w, torch.float32, reduce=True)[..., 0, :].to(x.dtype)  # (..., O)
        return func(*args, **kwargs)


def _layer_graph(layer: nn.Module, lanes: Tensor, offsets, lc, cache: DecodeCache, positions: Tensor, engram_kv,
                 site_flags: Tensor, perms) -> Tensor:
    """One layer of plain.decode_step, the compiled graph: lanes (B·S·n, D) -> the new lanes (B·S·n, D). The lanes
    travel flat and the conv rows leave contiguous, so that every layer and step sees the strides its graph was
    compiled for (a size-1 axis's stride is the caller's choice, and dynamo guards on it)."""
    B, S, n = lc.k.shape[0], positions.shape[0], offsets[0].shape[0]
    attention = functools.partial(_attention_step, layer.block.self_attn, lc=lc, cache=cache, positions=positions)
    with _FewRowProducts():
        lanes = _layer_step(layer, lanes.view(B, S, n, -1), offsets, attention, engram_kv, site_flags, perms)
    if lc.rows is not None:
        lc.rows = tuple(r.contiguous() for r in lc.rows)
    return lanes.reshape(B * S * n, -1)


def _dense(t: Tensor) -> Tensor:
    """t with row-major strides, size-1 dimensions included (is_contiguous ignores those; dynamo's guards do not)."""
    strides, size = [], 1
    for n in reversed(t.shape):
        strides.insert(0, size)
        size *= n
    return t if t.stride() == tuple(strides) else t.clone(memory_format=torch.contiguous_format)


def _tail_graph(model: nn.Module, lanes: Tensor) -> Tensor:
    """plain.decode_step's end: the lane mean, the final norm and model._logits' f32(x)·f32(E_out)ᵀ (B, S, V_out). With
    few rows the product is a multiply-and-sum (kernels.matmul_nt), so that inductor reads a bf16 output matrix in
    its own dtype inside the sum instead of writing its float32 copy first (the same function up to the order of
    the float32 sum)."""
    x = model.stack.final_norm(lanes.mean(dim=2))  # (B, S, D)
    head = model.embedding.weight
    if model.config.out_vocab:
        head = head[:model.config.out_vocab]
    return matmul_nt(x.float(), head, torch.float32, reduce=as_reduction(x.shape[0] * x.shape[1], x.device))


def compiled_step(model: nn.Module):
    """decode_step(model, tokens, cache, pos) for one request's one-token steps (B, 1): float32 logits (B, 1, V_out).

    One compiled graph per layer kind (local or global: the lanes' offsets, the site flags and the layer's weights are
    graph inputs), shared by every layer of that kind: a graph of one layer compiles in a fraction of a whole step's
    time. The end (final norm, logits) is one more graph. Graphs are cached per shapes and dtypes for the process
    (kernels.compiled: fullgraph, static shapes); each layer's first call of a request checks the guards (and picks or
    compiles its kind's graph), later calls skip them (kernels.CompiledStep: dynamo's diff guards still tell the kinds
    apart), and past dynamo's recompile limit the request runs eagerly with a warning."""
    cfg, device = model.config, model.embedding.weight.device
    layers = [CompiledStep(_layer_graph) for _ in range(cfg.num_layers)]  # one graph per kind, guarded per layer
    tail = CompiledStep(_tail_graph)
    perms = tuple(torch.as_tensor(p, device=device) for p in hada_perms(cfg.hada_dim, bool(cfg.ladder_widths)))
    offsets = [_lane_offsets(lane, cfg.mhc_lanes, device) for lane in range(cfg.mhc_lanes)]
    flags = [torch.tensor([float(site == i) for site in cfg.engram_layers], device=device)  # (G,)
             for i in range(cfg.num_layers)]

    def step(model: nn.Module, tokens: Tensor, cache: DecodeCache, pos: int) -> Tensor:
        B, S = tokens.shape
        positions = torch.arange(pos, pos + S, device=tokens.device)  # (S,)
        cache.tokens[:, cache.lead + pos:cache.lead + pos + S] = tokens
        engram_kv = _engram_step(model, cache, positions)
        x = model._input_embeddings(tokens)  # (B, S, D)
        lanes = x.to(model.stack.compute_dtype)[:, :, None, :].expand(B, S, cfg.mhc_lanes, cfg.d_model)  # (B,S,n,D)
        lanes = lanes.reshape(B * S * cfg.mhc_lanes, cfg.d_model)  # (B·S·n, D): how the layers' graph takes them
        for i, (layer, lc) in enumerate(zip(model.stack.layers, cache.layers, strict=True)):
            if lc is None:
                continue
            if lc.rows is not None:  # the prefill leaves views of its longer chunk: strides the graph never sees
                lc.rows = tuple(_dense(r) for r in lc.rows)
            lanes = layers[i](layer, lanes, offsets[lc.lane], lc, cache, positions, engram_kv, flags[i], perms)
        return tail(model, lanes.view(B, S, cfg.mhc_lanes, cfg.d_model))

    return step


@torch.inference_mode()
def generate(model: nn.Module, tokens, max_new_tokens: int = 64, *, layers: int | None = None,
             kv_window: int | None = None, temperature: float = 0.0, seed: int | None = None,
             eos_token_id: int | None = EOS_ID, pad_token_id: int = PAD_ID, return_logits: bool = False,
             return_logprobs: bool = False, streamer: Streamer | None = None):
    """needle_torch.v3.generate.generate (same arguments, same results) with compiled decoding steps."""
    prompts, valid, sampler, eos = _prepare(model, tokens, max_new_tokens, kv_window, layers, temperature, seed,
                                            eos_token_id, pad_token_id)
    B, P = prompts.shape
    G, device = int(max_new_tokens), prompts.device
    cache = new_cache(model, B, P + G, valid, kv_window, layers)
    prefill = decode_step(model, prompts, cache, 0, last_only=True)[:, 0]  # (B, V_out): chooses token 0
    eos_t, pad_t = (torch.tensor(i, device=device) for i in (eos, pad_token_id))
    step = compiled_step(model)

    def advance(t: int, out: Tensor, done: Tensor, noise: Tensor | None):
        logits = prefill if t == 0 else step(model, out[:, t - 1:t], cache, P + t - 1)[:, 0]
        return (logits, *pick(logits, done, eos_t, pad_t, noise, sampler.inv_temp))

    return _loop(advance, sampler, B, G, device, eos, pad_token_id, streamer, return_logits, return_logprobs)


__all__ = ["compiled_step", "generate"]
