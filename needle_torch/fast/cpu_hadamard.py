"""Torch-only speed code: Needle 2's Hadamard MLP over many float32 or bf16 rows as one C++ kernel, for compiled CPU
graphs.

The kernel (csrc/hadamard_mlp.cpp) computes HadamardMLP's function row by row, the Walsh products as butterflies
(P log P additions a row, then one multiply by H_P's entry) instead of a product with the dense matrix or its
Kronecker factors: the same function up to the order of the float32 sums. In bf16 it rounds to bf16 where eager's
bf16 tensors round (each product with d1, d2, d3, each Walsh product once, the sigmoid's exp, sum and quotient, the
silu's product), as the C++ decoding step does, where the compiled torch form keeps its fused intermediates in
float32: at 2048 random rows of the published width 0.07 % of the kernel's outputs differ from eager's (a Walsh sum
rounding the other way), 60 % of the compiled torch form's. It is built through inductor's own C++ toolchain and
cache, once per (D, P, dtype), and enters compiled graphs as the custom op `needle_twin::hadamard_mlp`.

Why: compiled, the MLP at many rows is several library products, each a pass over the rows; here each row stays
in L1 from its load to its store.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from needle_torch.fast.kernels import (
    CPP_SCALARS,
    REDUCE_MAX_ROWS,
    build_once,
    cpp_kernel,
    enabled,
    graph_calls,
    walsh_entry,
)

# Both widths must fill whole float vectors: 16 lanes with AVX-512, 8 with AVX2.
WIDTH_MULTIPLE = 16
_SOURCE = Path(__file__).with_name("csrc") / "hadamard_mlp.cpp"
_built: dict[str, object] = {}  # _key(D, P, dtype) -> the kernel
_ready: dict[str, bool] = {}  # the same keys -> built (False: it did not); plain values, which compiled graphs guard on


def _key(d_model: int, hada: int, dtype: torch.dtype = torch.float32) -> str:
    return f"{d_model}/{hada}/{'bf16' if dtype == torch.bfloat16 else 'f32'}"  # traced code: no dict lookup on a dtype


def _build(d_model: int, hada: int, dtype: torch.dtype):
    scalar = CPP_SCALARS[dtype]
    argtypes = [f"const {scalar}*"] * 4 + [f"{scalar}*", "int64_t", "float"]
    return cpp_kernel(_SOURCE, (("SCALAR", scalar), ("DMODEL", d_model), ("HADA", hada)), argtypes)


def prepare(d_model: int, hada: int, dtype: torch.dtype, device: torch.device) -> None:
    """Build the kernel compiled graphs of this width will call, if they take one (before compiling: the build
    runs eagerly, and a failure leaves the torch form in place with one kernels.KernelBuildWarning)."""
    if (not enabled() or device.type != "cpu" or dtype not in CPP_SCALARS or d_model % WIDTH_MULTIPLE
            or hada % WIDTH_MULTIPLE):
        return
    build_once(_key(d_model, hada, dtype), lambda: _build(d_model, hada, dtype), _built, _ready,
               "CPU Hadamard MLP kernel", "compiled graphs use the torch form (same function, slower)")


def applies(x: Tensor, d1: Tensor) -> bool:
    """Whether the MLP of x (..., D) with weights of width P runs through the kernel: a compiled CPU graph, float32 or
    bf16 rows and weights of one dtype, more rows than kernels.REDUCE_MAX_ROWS (fewer stay one fused reduction),
    inference, a built kernel."""
    return (x.dtype == d1.dtype and x.dtype in CPP_SCALARS and x.shape[:-1].numel() > REDUCE_MAX_ROWS
            and graph_calls(x.device, _ready, _key(x.shape[-1], d1.shape[0], x.dtype)))


@torch.library.custom_op("needle_twin::hadamard_mlp", mutates_args=())
def hadamard_mlp(x: Tensor, d1: Tensor, d2: Tensor, d3: Tensor) -> Tensor:
    """x (R, D) float32, d1, d2, d3 (P,) float32 -> (R, D): HadamardMLP's function (prepare() first)."""
    P = d1.shape[0]
    x = x.contiguous()
    out = torch.empty_like(x)
    _built[_key(x.shape[1], P, x.dtype)](x, d1.contiguous(), d2.contiguous(), d3.contiguous(), out, x.shape[0],
                                         _entry(P, x.dtype))
    return out


_entry = functools.cache(walsh_entry)  # H_P's entry, once per width (a float32 tensor's value each time otherwise)


@hadamard_mlp.register_fake
def _(x: Tensor, d1: Tensor, d2: Tensor, d3: Tensor) -> Tensor:
    return torch.empty_like(x)


def mlp(x: Tensor, d1: Tensor, d2: Tensor, d3: Tensor) -> Tensor:
    """HadamardMLP of x (..., D) through the kernel (where `applies`)."""
    return hadamard_mlp(x.reshape(-1, x.shape[-1]), d1, d2, d3).view(x.shape)
