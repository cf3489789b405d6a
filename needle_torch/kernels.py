"""Torch-only speed code: products written as reductions under torch.compile, and the compiled-step wrapper.

Nothing here changes what a model computes, only how: the reduction form equals the library
matmul up to the order of the float32 sum, and a compiled step is the eager step traced once.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Under torch.compile on CPU, a product with at most this many rows (a decode step's few tokens) is written
# as a multiply-and-sum. Inductor then fuses it with the ops around it into one vectorised pass that reads
# each weight once in its stored dtype (bf16 weights upcast in registers), where a GEMV call per projection
# is bound by call overhead at this size (published size, bf16, batch 1: 2.4 ms a step against 6.5 ms with
# the oneDNN calls; batch 4: 443 against 361 tokens/s; batch 8: 473 against 540, hence 4). Eager mode,
# larger products and GPUs (not measured here; cuBLAS has its own GEMV) keep the library kernels.
REDUCE_MAX_ROWS = 4


def reduces_when_compiled(rows: int, device: torch.device) -> bool:
    """Whether a compiled product with `rows` rows on `device` is written as a multiply-and-sum (CPU, few rows)."""
    return device.type == "cpu" and rows <= REDUCE_MAX_ROWS


def as_reduction(rows: int, device: torch.device) -> bool:
    """Whether a product with `rows` rows on `device` is written as a multiply-and-sum here (compiling)."""
    return torch.compiler.is_compiling() and reduces_when_compiled(rows, device)


def matmul_nt(a: Tensor, b: Tensor, dtype: torch.dtype, reduce: bool = False) -> Tensor:
    """a (..., M, I) @ b (..., N, I)^T -> (..., M, N) in `dtype`: products and sums in float32, rounded once.

    That is what a `dtype` matmul computes on CPU and GPU (float32 accumulation); `reduce` writes it as
    a broadcast multiply-and-sum (see REDUCE_MAX_ROWS), equal up to the order of the float32 sum.
    """
    if reduce:
        return (a.float()[..., :, None, :] * b.float()[..., None, :, :]).sum(-1).to(dtype)
    return torch.matmul(a.to(dtype), b.to(dtype).transpose(-1, -2))


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose few-row products under torch.compile are reductions."""

    def forward(self, x: Tensor) -> Tensor:
        if not as_reduction(x.shape[:-1].numel(), x.device):
            return F.linear(x, self.weight, self.bias)
        y = matmul_nt(x[..., None, :], self.weight, torch.float32, reduce=True)[..., 0, :]  # (..., O) float32
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


def repeated_region(fn: Callable) -> Callable:
    """Mark `fn` (one layer's work, the layer module its first argument) as torch.compile's nested compile
    region: traced and compiled once, then stamped out for every layer of a compiled step instead of being
    retraced for each. Eagerly a plain call. The region is reused only while its inputs look alike (shapes,
    dtypes, constants), so whatever differs per layer must come in as a tensor."""
    return torch.compiler.nested_compile_region(fn)


# ----------------------------------------------------------------------------- compiled steps


class CompileFallbackWarning(RuntimeWarning):
    """A compiled generation request ran eagerly (slower, same function)."""


RECOMPILE_LIMIT_HIT = ("torch.compile reached its recompile limit in this process, so this request runs eagerly "
                       "(slower); use fewer distinct batch sizes, source lengths, max_new_tokens, dtypes or "
                       "mask/suppress variants per process, or raise torch._dynamo.config.recompile_limit")

_compiled: dict[Callable, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile (one wrapper per function; graphs cached per shapes, dtypes and None-ness of its
    arguments, up to torch._dynamo.config.recompile_limit: past it, `call_compiled` runs eagerly and warns)."""
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _compiled[fn]


def skip_guards() -> AbstractContextManager:
    """Later steps repeat step 0's call with the same model, cache and shapes: skip re-checking its ~200 tensor
    guards (0.28 ms of a 3 ms step at batch 1; 0.07 ms with the skip). Diff guards still pick the graph."""
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)


class CompiledStep:
    """Calls `fn` compiled, the first call guarded (it compiles or picks the graph), later calls without guard
    evaluation; past dynamo's recompile limit the whole request runs `fn` eagerly with a CompileFallbackWarning."""

    def __init__(self, fn: Callable) -> None:
        self.fn, self._compiled, self._calls = fn, compiled(fn), 0

    def __call__(self, *args):
        self._calls += 1
        if self._compiled is None:
            return self.fn(*args)
        if self._calls > 1:
            with skip_guards():  # only around our own call: a streamer's compiled code keeps its guards
                return self._compiled(*args)
        try:
            return self._compiled(*args)
        except torch._dynamo.exc.FailOnRecompileLimitHit:
            warnings.warn(RECOMPILE_LIMIT_HIT, CompileFallbackWarning, stacklevel=3)
            self._compiled = None  # eager with the same arguments, for the whole request
            return self.fn(*args)
