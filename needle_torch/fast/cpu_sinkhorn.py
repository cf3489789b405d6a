"""Torch-only speed code: Needle 2's lane-routing Sinkhorn over many rows as one C++ kernel, for compiled CPU graphs.

The kernel (csrc/sinkhorn.cpp) runs lanes.sinkhorn's steps in their order (20 times rows then columns less their
logsumexp, written as lanes._logsumexp writes it under compile, then exp) on float32 (n, n) logits, 16 rows at a
time transposed into vector lanes so that the whole matrix stays in registers: the same function up to the last
bits of the vector exp and log. It is built through inductor's own C++ toolchain and cache, once per lane count, and
enters compiled graphs as the custom op `needle_twin::sinkhorn`.

Why: compiled, the 40 logsumexp steps are 40 passes over the tokens and 40 buffers a layer; here each row's
matrix stays in registers.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from needle_torch.fast.kernels import REDUCE_MAX_ROWS, build_once, cpp_kernel, enabled, graph_calls

_SOURCE = Path(__file__).with_name("csrc") / "sinkhorn.cpp"
_built: dict[int, object] = {}  # lanes -> the kernel
_ready: dict[int, bool] = {}  # lanes -> built (False: it did not); plain values, which compiled graphs guard on


def _build(lanes: int):
    return cpp_kernel(_SOURCE, (("LANES", lanes),), ["const float*", "float*", "int64_t", "int64_t"])


def prepare(lanes: int, device: torch.device) -> None:
    """Build the kernel compiled graphs with `lanes` lanes will call (before compiling: the build runs eagerly, and a
    failure leaves the torch form in place with one kernels.KernelBuildWarning)."""
    if enabled() and device.type == "cpu":
        build_once(lanes, lambda: _build(lanes), _built, _ready, "CPU Sinkhorn kernel",
                   "compiled graphs use the torch form (same function, slower)")


def applies(z: Tensor) -> bool:
    """Whether the Sinkhorn of float32 logits z (..., n, n) runs through the kernel: a compiled CPU graph, more rows
    than kernels.REDUCE_MAX_ROWS (fewer stay fused into their layer), inference, a built kernel."""
    return (z.dtype == torch.float32 and z.shape[:-2].numel() > REDUCE_MAX_ROWS
            and graph_calls(z.device, _ready, z.shape[-1]))


@torch.library.custom_op("needle_twin::sinkhorn", mutates_args=())
def sinkhorn_op(z: Tensor, iters: int) -> Tensor:
    """exp of `iters` Sinkhorn steps of z (R, n, n) float32 -> (R, n, n) (prepare() first)."""
    z = z.contiguous()
    out = torch.empty_like(z)
    _built[z.shape[-1]](z, out, z.shape[0], iters)
    return out


@sinkhorn_op.register_fake
def _(z: Tensor, iters: int) -> Tensor:
    return torch.empty_like(z)


def sinkhorn(z: Tensor, iters: int) -> Tensor:
    """lanes.sinkhorn of z (..., n, n) through the kernel (where `applies`)."""
    n = z.shape[-1]
    return sinkhorn_op(z.reshape(-1, n, n), iters).view(z.shape)
