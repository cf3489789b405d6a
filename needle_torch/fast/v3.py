"""Needle 3's one-token decoding steps through torch.compile: `compiled_step(model)` is
`needle_torch.v3.generate.decode_step` with each layer run by a compiled graph of the plain
`needle_torch.v3.generate.layer_decode` (`generate(..., compile=True)` uses it after the prefill).

The graph takes the layer module as an argument (its weights are graph inputs), so one graph serves every layer of a
kind: local and global layers differ in the ring's window, which the graph bakes in. The engram's key and value,
the embeddings and the logits run as the plain step runs them. Graphs are cached per shapes and dtypes for the process
(kernels.compiled: fullgraph, static shapes), so a request of a new shape compiles; each layer's first call of a request
checks dynamo's guards, later calls skip them (kernels.CompiledStep), and past dynamo's recompile limit the request
runs eagerly with a warning.

Few-row products are left to inductor: writing them as float32 multiply-and-sum reductions (kernels.matmul_nt), as
Needle 2's compiled step does, made the default config's batch-1 step 1.1-1.2x faster, too little for the code.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from needle_torch.fast.kernels import CompiledStep
from needle_torch.v3.generate import decode_step, layer_decode


def _dense(t: Tensor) -> Tensor:
    """t with row-major strides, size-1 dimensions included: dynamo guards on every stride (is_contiguous ignores
    a size-1 axis's), and the prefill's conv rows and the first layer's expanded lanes have others."""
    strides, size = [], 1
    for n in reversed(t.shape):
        strides.insert(0, size)
        size *= n
    return t if t.stride() == tuple(strides) else t.clone(memory_format=torch.contiguous_format)


def compiled_step(model: nn.Module):
    """decode_step(model, tokens, cache, pos) for one request's steps, each layer a compiled layer_decode graph."""
    graphs = {id(layer): CompiledStep(layer_decode) for layer in model.stack.layers}  # the first call guarded

    def layer_step(layer, lanes, lc, cache, positions, engram_kv, site_flags, offsets):
        if lc.rows is not None:
            lc.rows = tuple(_dense(r) for r in lc.rows)
        return graphs[id(layer)](layer, _dense(lanes), lc, cache, positions, engram_kv, site_flags, offsets)

    return functools.partial(decode_step, layer_step=layer_step)


__all__ = ["compiled_step"]
