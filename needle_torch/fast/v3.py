"""Needle 3's fast forms: the compiled one-token decoding step, and the pieces seam.fast_paths swaps in.

`compiled_step(model)` is `needle_torch.v3.generate.decode_step` with compiled graphs of the plain pieces it runs
(`generate(..., compile=True)` uses it after the prefill): the engram's keys and values (`engram_step`), the layers
in runs (`decode_layers`) and the logits (`step_logits`). A run is the shortest sequence of layer kinds (local or
global: the ring's window and shape, which a graph bakes in) that tiles the stack, up to LONGEST_RUN layers (the
default config's 4 local and 1 global: 4 calls of one graph a step); the layer modules are graph arguments, so
runs of a kind share a graph. Graphs are cached per shapes and dtypes for the process (kernels.compiled: fullgraph,
static shapes), so a request of a new shape compiles; each graph's first call of a request checks dynamo's
guards, later calls skip them (kernels.CompiledStep), and past dynamo's recompile limit the request runs eagerly
with a warning.

Inside those graphs on CPU, products of few rows (a decode step's projections and tied logits) are multiply-and-sums
(`Dense`, `logits`): inductor reads each weight once in a parallel loop at close to the memory's bandwidth, where
the library's one-row product reads at about half of it; their inputs are stored once (kernels.stored).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from needle_torch.fast.kernels import CompiledStep, as_reduction, linear_f32, matmul_nt, stored, upcasts
from needle_torch.v3.generate import LayerCache, decode_layers, decode_positions, decode_step, engram_step, step_logits
from needle_torch.v3.model import SimpleAttentionNetwork, _aq, _Dense


def _dense(t: Tensor) -> Tensor:
    """t with row-major strides, size-1 dimensions included: dynamo guards on every stride (is_contiguous ignores
    a size-1 axis's), and the first layer's expanded lanes have others."""
    strides, size = [], 1
    for n in reversed(t.shape):
        strides.insert(0, size)
        size *= n
    return t if t.stride() == tuple(strides) else t.clone(memory_format=torch.contiguous_format)


class Dense(_Dense):
    """_Dense (the same parameters) whose few-row products in a compiled CPU graph are multiply-and-sums, and whose
    other bf16 products on the upcast path (kernels.bf16_path) are kernels.linear_f32's."""

    def forward(self, x: Tensor) -> Tensor:
        dt = self.compute_dtype
        if not as_reduction(x.shape[:-1].numel(), x.device):
            if upcasts(dt, x.device):  # against a kept float32 copy of the bf16 weight where linear_f32 packs one
                return linear_f32(x.to(dt).float(), self.weight.to(dt)).to(dt)
            return super().forward(x)
        return matmul_nt(stored(x.to(dt))[..., None, :], self.weight.to(dt), dt, reduce=True)[..., 0, :]


def logits(self: SimpleAttentionNetwork, x: Tensor, quant: bool) -> Tensor:
    """SimpleAttentionNetwork._logits; in a compiled CPU graph of few rows a multiply-and-sum over the tied rows."""
    if not as_reduction(x.shape[:-1].numel(), x.device):
        return _PLAIN_LOGITS(self, x, quant)
    head = self.embedding.weight
    if self.config.out_vocab:
        head = head[:self.config.out_vocab]
    return matmul_nt(stored(_aq(x, quant, self.config.act_bits).float())[..., None, :], head, torch.float32,
                     reduce=True)[..., 0, :]  # (B, T, V_out)


def module_swaps(net: nn.Module) -> list[tuple[nn.Module, type]]:
    """Every projection of the stack and the engram sites (seam.fast_paths)."""
    return [(m, Dense) for m in net.modules() if type(m) is _Dense]


_PLAIN_LOGITS = SimpleAttentionNetwork._logits
# What replaces the plain pieces inside fast_paths: (owner, attribute, fast form).
SWAPS = ((SimpleAttentionNetwork, "_logits", logits),)
LINEAR = None
UPCAST_PRODUCTS = True  # bf16 products as float32 ones where the CPU has no bf16 units (kernels.UpcastProducts)

# Inductor's C++ wrapper: a graph's kernels called from C++, not from Python (a batch-1 step of the default config
# 17.5 against 21.3 ms on a 2-core AVX2-only AMD EPYC).
GRAPH_OPTIONS = {"cpp_wrapper": True}
LONGEST_RUN = 5  # layers in one graph at most: the default config's period (4 local, 1 global); compile time grows


def _kind(lc: LayerCache) -> tuple:
    """What a layer's graph bakes in from its cache: the window, the ring's and store's shapes, the conv rows."""
    return lc.window, tuple(lc.k.shape), lc.store_k is None, lc.rows is None


def run_length(kinds: list, longest: int = LONGEST_RUN) -> int:
    """The shortest run r <= longest whose kinds tile the layers' (kinds[i] == kinds[i % r]), else 1."""
    for r in range(1, min(longest, len(kinds)) + 1):
        if len(kinds) % r == 0 and all(k == kinds[i % r] for i, k in enumerate(kinds)):
            return r
    return 1


def compiled_step(model: nn.Module):
    """decode_step(model, tokens, cache, pos) for one request's steps, its engram, its runs of layers and its logits
    each a compiled graph."""
    engram, head = CompiledStep(engram_step, GRAPH_OPTIONS), CompiledStep(step_logits, GRAPH_OPTIONS)
    runs: dict[int, CompiledStep] = {}  # by the run's first layer: each checks its guards once

    def layers(active, lanes, cache, positions, engram_kv):
        r = run_length([_kind(lc) for _, lc in active])
        for start in range(0, len(active), r):
            graph = runs.setdefault(start, CompiledStep(decode_layers, GRAPH_OPTIONS))
            lanes = graph(active[start:start + r], _dense(lanes), cache, positions, engram_kv)
        return lanes

    step = functools.partial(decode_positions, engram=engram, layers=layers, logits=head)
    return functools.partial(decode_step, step=step)


__all__ = ["GRAPH_OPTIONS", "LINEAR", "LONGEST_RUN", "SWAPS", "UPCAST_PRODUCTS", "Dense", "compiled_step", "logits",
           "module_swaps", "run_length"]
