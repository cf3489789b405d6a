"""Torch-only speed code: a Needle 2 cached-decoding step as C++ kernels, for few rows on CPU.

csrc/decode_step.cpp holds three kernels, each one OpenMP parallel region: both engram sites' key and value for the
newest token (Engram.forward with last=1), one lane layer (MHCLayer's forward: the lane routing with its
Sinkhorn, the block's engram injection, gated q/k-normed attention over the K/V cache and Hadamard MLP, the lane
mix) and the step's end (lane mean, final_norm, tied logits). They keep the eager twin's order of operations and
its roundings to the compute dtype, and differ from it only in the order of float32 sums (dot products, the Walsh
transform as butterflies instead of a dense product): float32 layers within 8.4e-7 of eager, bf16 layers bit for
bit in nearly every element. Built through inductor's C++ toolchain and cache once per (kernel, dtype, model
shape); a step calls them with tables of parameter pointers, 3 calls (the lane layers in one), no graph.

Why: at few rows a compiled torch step spends its time between kernels (the wrapper's Python calls, a dozen
parallel regions a layer), not in them; hence MAX_ROWS and BF16_MAX_ROWS. With AMX tiles, bf16 products of 4 rows
or more run on them; products of few rows read weight rows one stream per thread with an L2 prefetch
(ROW_PREFETCH), which reads at a one-thread `sum`'s bandwidth where 4 interleaved rows did not.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from needle_torch.fast.kernels import (
    CPP_SCALARS,
    bare_linear,
    build_once,
    cpp_kernel,
    enabled,
    hooked,
    product_path,
    walsh_entry,
)

# The most rows a step runs through the kernels; more keep the torch.compile step (see the module docstring). Where
# bf16 products run on the CPU's bf16 units (dot products, AMX tiles) the kernels stay ahead of it up to batch 32:
# BF16_MAX_ROWS (max_rows).
MAX_ROWS = 16
BF16_MAX_ROWS = 32
# Every width the kernels vectorise must fill whole float vectors: 16 lanes with AVX-512, 8 with AVX2.
WIDTH_MULTIPLE = 16
_SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
LAYER, ENGRAM, HEAD = 1, 2, 3  # the source's ENTRY values
# A lane layer's tensors in the kernel's pointer-table order (decode_step.cpp's Slot): the lane layer's own
# parameters, its lane offsets, the block's parameters, then its K and V buffers.
PARAMETERS = ("phi_pre.weight", "phi_post.weight", "phi_res.weight", "b_pre", "b_post", "b_res", "a_pre",
              "a_post", "a_res")
BLOCK_PARAMETERS = (
    "pre_attn_norm.scale", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.q_norm.scale", "self_attn.k_norm.scale", "self_attn.gate_proj.weight", "self_attn.out_proj.weight",
    "post_attn_norm.scale", "attn_gate", "pre_hada_norm.scale", "hadamard_mlp.d1", "hadamard_mlp.d2",
    "hadamard_mlp.d3",
)
ENGRAM_PARAMETERS = ("embedding", "key_proj.weight", "value_proj.weight", "taps")
_ARGTYPES = {
    LAYER: ["const int64_t*", "int64_t", "T*", "T*", "const bool*", "const float*", "const float*", "const float*",
            "const T*", "const int64_t*", "int64_t", "int64_t", "int64_t", "float", "float", "int64_t"],
    ENGRAM: ["const int64_t*", "const int64_t*", "const bool*", "float*", "T*", "int64_t", "int64_t"],
    HEAD: ["const int64_t*", "const T*", "float*", "int64_t", "int64_t", "int64_t"],
}
_built: dict[tuple, object] = {}  # _defines(dtype, config) -> the three kernels
_ready: dict[tuple, bool] = {}


def _defines(dtype: torch.dtype, config) -> tuple[tuple[str, object], ...]:
    return (
        ("SCALAR", CPP_SCALARS[dtype]), ("LANES", config.mhc_lanes), ("DMODEL", config.d_model),
        ("ATTN", config.attn_dim), ("HEADS", config.num_heads), ("KVHEADS", config.num_kv_heads),
        ("HEAD", config.head_dim), ("HADA", config.hada_dim),
        ("ENGRAM_ORDERS", ", ".join(str(o) for o in config.engram_orders)),
        ("ENGRAM_HEADS", config.engram_heads_resolved), ("ENGRAM_SLOTS", config.engram_slots),
        ("ENGRAM_SUB", config.engram_sub_dim), ("ENGRAM_SITES", config.num_sites))


def _build(dtype: torch.dtype, config) -> dict[int, object]:
    """The three kernels, compiled side by side (the compiler runs outside the GIL): 24 s one after the other at
    the published size on 2 cores, cold; inductor's disk cache serves later processes in milliseconds."""
    scalar = CPP_SCALARS[dtype]

    def one(entry: int):
        argtypes = [a.replace("T*", f"{scalar}*") for a in _ARGTYPES[entry]]
        return cpp_kernel(_SOURCE, (("ENTRY", entry), *_defines(dtype, config)), argtypes)

    with ThreadPoolExecutor(len(_ARGTYPES)) as pool:
        return dict(zip(_ARGTYPES, pool.map(one, _ARGTYPES), strict=True))


def _shaped(config) -> bool:
    """Whether the model's widths are ones the kernels take (else they would not build)."""
    widths = (config.d_model, config.attn_dim, config.head_dim, config.engram_sub_dim * config.num_engram_tables)
    return all(w % WIDTH_MULTIPLE == 0 for w in widths) and config.hada_dim >= config.d_model


def _plain(model: nn.Module) -> bool:
    """Whether what a decoding step runs (the embedding, the engram sites, the stack) is the twin's own code:
    Linear projections without bias (not a LoRA wrapper), no hooks (a parity tap records through them), contiguous
    parameters in the model's dtype, flash attention."""
    parts = (model.embedding, model.engrams, model.stack)
    for module in (m for part in parts for m in part.modules()):
        if hooked(module) or (isinstance(module, nn.Linear) and not bare_linear(module)):
            return False
    if any(p.dtype != model.dtype or not p.is_contiguous() for part in parts for p in part.parameters()):
        return False
    return model.config.flash and not hooked()


def max_rows(dtype: torch.dtype) -> int:
    """The most rows a step of this dtype runs through the kernels: BF16_MAX_ROWS where its products take the CPU's
    bf16 units (product_path 1 or 2: bf16 on a CPU with the AVX512-BF16 dot products, with or without AMX tiles),
    else MAX_ROWS."""
    return BF16_MAX_ROWS if product_path(dtype) >= 1 else MAX_ROWS


def applies(model: nn.Module, rows: int) -> bool:
    """Whether cached-decoding steps of `rows` rows can run through the kernels: CPU, float32 or bf16, at most
    max_rows(dtype) rows, widths they take, the twin's own plain modules (_plain). Builds the kernels on first use;
    a failed build warns once (kernels.KernelBuildWarning) and answers False from then on."""
    if (not enabled() or model.device.type != "cpu" or model.dtype not in CPP_SCALARS
            or not 1 <= rows <= max_rows(model.dtype) or not _shaped(model.config) or not _plain(model)):
        return False
    return build_once(_defines(model.dtype, model.config), lambda: _build(model.dtype, model.config), _built, _ready,
                      "CPU decoding kernels", "compiled steps use torch.compile (same function, slower at small "
                      "batches)")


def _table(tensors: list[Tensor]) -> Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


@dataclass
class Fused:
    """One request's kernel state: the kernels, the lane layers' pointer tables (int64 (L, 27)) and the engram site
    each layer injects (int64 (L,), -1 for none), the engram sites' table (4 pointers a site) and the head's, the
    tensors they point into (kept alive with them), the Walsh matrix's entry cast(1/√P), the masked logit, the
    buffer length M, how the bf16 products run (dp: 0 float32 multiply-adds on upcast loads, 1 the CPU's bf16 dot
    products, 2 AMX tiles too), and the shapes the outputs take (sites G, d_model D, vocab V, compute dtype)."""

    kernels: dict[int, object]
    layers: Tensor
    site: Tensor
    engram: Tensor
    head: Tensor
    tensors: list[Tensor]
    walsh_entry: float
    masked: float
    length: int
    dp: int
    sites: int
    d_model: int
    vocab: int
    dtype: torch.dtype


def fuse(model: nn.Module, k: list[Tensor], v: list[Tensor], offsets: list[tuple[Tensor, Tensor]],
         masked: float) -> Fused:
    """The kernels' state for a request whose cache holds K/V buffers k, v (one (B, K, M, h) per layer) and these
    lane offsets; call applies() first. The tables hold data pointers, so they are built per request: a model
    moved or reloaded between requests is read where it now lives."""
    layers, tensors = [], []
    for i, layer in enumerate(model.stack.layers):
        parts = [layer.get_parameter(name) for name in PARAMETERS] + [*offsets[i]]
        parts += [layer.block.get_parameter(name) for name in BLOCK_PARAMETERS] + [k[i], v[i]]
        tensors += parts
        layers.append(_table(parts))
    sites = [engram.get_parameter(name) for engram in model.engrams for name in ENGRAM_PARAMETERS]
    head = [model.stack.final_norm.scale, model.embedding.weight]
    tensors += sites + head
    P = model.config.hada_dim
    entry = walsh_entry(P, model.dtype)
    dp = product_path(model.dtype)
    cfg = model.config
    site = torch.tensor([model.stack.sites.index(i) if i in model.stack.sites else -1 for i in range(len(layers))],
                        dtype=torch.int64)
    return Fused(_built[_defines(model.dtype, cfg)], torch.stack(layers), site, _table(sites), _table(head), tensors,
                 entry, masked, k[0].shape[2], dp, cfg.num_sites, cfg.d_model, cfg.vocab_size, model.dtype)


def engram(fused: Fused, hist: Tensor, hist_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Every site's (rms_unit(key) (G, B, 1, D) float32, value (G, B, 1, D)) for the newest token of each row, from
    the history window hist (B, W + 1) int64 and its validity (B, W + 1) bool (model._decode_engram's inputs)."""
    B = hist.shape[0]
    ek = torch.empty(fused.sites, B, 1, fused.d_model)
    ev = torch.empty(fused.sites, B, 1, fused.d_model, dtype=fused.dtype)
    fused.kernels[ENGRAM](fused.engram, hist.contiguous(), hist_valid.contiguous(), ek, ev, B, fused.dp)
    return ek, ev


def run_layers(fused: Fused, x0: Tensor, lanes: int, mask: Tensor, cos: Tensor, sin: Tensor, pos: int,
               ek_unit: Tensor | None, ev: Tensor | None) -> Tensor:
    """The lane layers of one decoding step, in one kernel call: x0 (B, 1, D) in the compute dtype -> the lanes
    (B, 1, n, D).

    mask (B, 1, 1, pos + 1) over the keys (make_decode_mask); cos, sin (1, h/2) at position pos; ek_unit and ev
    (G, B, 1, D), contiguous (engram()'s), every engram site's rms_unit(key) and value (fused.site: which layer
    injects which), or None for a model without engram sites."""
    B, _, D = x0.shape
    x = x0[:, :, None, :].expand(B, 1, lanes, D).contiguous()  # (B, 1, n, D)
    y = torch.empty_like(x)
    _call(fused, fused.layers, fused.site, x, y, mask.reshape(B, -1).contiguous(), cos, sin, pos, ek_unit, ev)
    return x if len(fused.layers) % 2 == 0 else y


def layer(fused: Fused, i: int, lanes: Tensor, out: Tensor, mask: Tensor, cos: Tensor, sin: Tensor, pos: int,
          engram: tuple[Tensor, Tensor] | None = None) -> None:
    """Lane layer i of a decoding step alone: lanes (B, 1, n, D) -> out (the same shape, written), K and V into the
    cache at pos. mask (B, pos + 1) bool over the keys; cos, sin (1, h/2) at pos; engram: this layer's site's
    (rms_unit(key), value), each (B, 1, D), or None."""
    ek, ev = (None, None) if engram is None else (engram[0].contiguous(), engram[1].contiguous())
    _call(fused, fused.layers[i:i + 1], torch.tensor([-1 if engram is None else 0]), lanes, out, mask, cos, sin, pos,
          ek, ev)


def _call(fused: Fused, tables: Tensor, site: Tensor, x: Tensor, y: Tensor, mask: Tensor, cos: Tensor, sin: Tensor,
          pos: int, ek: Tensor | None, ev: Tensor | None) -> None:
    """The layer kernel over tables' layers, x and y each layer's input and output in turn (decode_step.cpp); ek, ev
    None where no layer has an engram site (every site -1: the kernel reads neither)."""
    if ek is None:
        ek, ev = x.new_empty(0, dtype=torch.float32), x.new_empty(0)
    fused.kernels[LAYER](tables, len(tables), x, y, mask, cos, sin, ek, ev, site, x.shape[0], pos, fused.length,
                         fused.walsh_entry, fused.masked, fused.dp)


def logits(fused: Fused, lanes: Tensor) -> Tensor:
    """The step's float32 logits (B, 1, V) from the last layer's lanes (B, 1, n, D): lane mean, final_norm, tied
    output (model.Stack.forward's end, then model._decode_logits)."""
    B = lanes.shape[0]
    out = torch.empty(B, 1, fused.vocab)
    fused.kernels[HEAD](fused.head, lanes, out, B, fused.vocab, fused.dp)
    return out


__all__ = ["BF16_MAX_ROWS", "MAX_ROWS", "Fused", "applies", "engram", "fuse", "layer", "logits", "max_rows",
           "product_path", "run_layers"]
