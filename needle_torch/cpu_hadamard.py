"""Torch-only speed code: Needle 2's Hadamard MLP over many float32 rows as one C++ kernel, for compiled CPU graphs.

The kernel (csrc/hadamard_mlp.cpp) computes HadamardMLP's float32 function row by row, the Walsh products as
butterflies (P log P additions a row, then one multiply by H_P's entry) instead of a product with the dense matrix or
its Kronecker factors: the same function up to the order of the float32 sums. It is built through inductor's own C++
toolchain and cache, once per (D, P), and enters compiled graphs as the custom op `needle_twin::hadamard_mlp`.

Why: compiled, the MLP at many rows took two library products (MKL) and a batched one per Walsh transform, each a
pass over the rows, plus the fused elementwise kernels between them; here each row stays in L1 from its load to its
store. Published size (D = P = 512), float32, 2 threads of a 2-core Zen 4 EPYC, the kernel and the torch form
alternating in one process: the compiled MLP alone at 2048 rows (a prefill chunk) 2.3 against 4.6 ms, at 32 rows (a
batch-32 step) 0.063 against 0.096 ms (medians of 40); in the batch-32 compiled prefill of 256-token prompts
(profiled, medians of 4) the op took 219 ms where the Walsh products took 263 ms, and the fused kernels 882 against
930 ms; batch-32 steps 57.0 against 57.9 ms (medians of 80 pairs, faster in 70 %). The 16-lane butterflies inside a
vector run as one product with H_16's rows (the scalar butterflies took 3.6 ms at 2048 rows, this 1.2 ms).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

from needle_torch.kernels import REDUCE_MAX_ROWS, build_once, cpp_kernel, graph_calls, walsh_entry

# Both widths must fill whole float vectors: 16 lanes with AVX-512, 8 with AVX2.
WIDTH_MULTIPLE = 16
_SOURCE = Path(__file__).with_name("csrc") / "hadamard_mlp.cpp"
_built: dict[str, object] = {}  # _key(D, P) -> the kernel
_ready: dict[str, bool] = {}  # the same keys -> built (False: it did not); plain values, which compiled graphs guard on


def _key(d_model: int, hada: int) -> str:
    return f"{d_model}/{hada}"


def _build(d_model: int, hada: int):
    argtypes = ["const float*", "const float*", "const float*", "const float*", "float*", "int64_t", "float"]
    return cpp_kernel(_SOURCE, (("DMODEL", d_model), ("HADA", hada)), argtypes)


def prepare(d_model: int, hada: int, dtype: torch.dtype, device: torch.device) -> None:
    """Build the kernel compiled graphs of this width will call, if they take one (before compiling: the build
    runs eagerly, and a failure leaves the torch form in place with one kernels.KernelBuildWarning)."""
    if device.type != "cpu" or dtype != torch.float32 or d_model % WIDTH_MULTIPLE or hada % WIDTH_MULTIPLE:
        return
    build_once(_key(d_model, hada), lambda: _build(d_model, hada), _built, _ready, "CPU Hadamard MLP kernel",
               "compiled graphs use the torch form (same function, slower)")


def applies(x: Tensor, d1: Tensor) -> bool:
    """Whether the MLP of x (..., D) with weights of width P runs through the kernel: a compiled CPU graph, float32,
    more rows than kernels.REDUCE_MAX_ROWS (fewer stay one fused reduction), inference, a built kernel."""
    return (x.dtype == torch.float32 == d1.dtype and x.shape[:-1].numel() > REDUCE_MAX_ROWS
            and graph_calls(x.device, _ready, _key(x.shape[-1], d1.shape[0])))


@torch.library.custom_op("needle_twin::hadamard_mlp", mutates_args=())
def hadamard_mlp(x: Tensor, d1: Tensor, d2: Tensor, d3: Tensor) -> Tensor:
    """x (R, D) float32, d1, d2, d3 (P,) float32 -> (R, D): HadamardMLP's function (prepare() first)."""
    P = d1.shape[0]
    x = x.contiguous()
    out = torch.empty_like(x)
    _built[_key(x.shape[1], P)](x, d1.contiguous(), d2.contiguous(), d3.contiguous(), out, x.shape[0], _entry(P))
    return out


_entry = functools.cache(walsh_entry)  # H_P's entry, once per width (a float32 tensor's value each time otherwise)


@hadamard_mlp.register_fake
def _(x: Tensor, d1: Tensor, d2: Tensor, d3: Tensor) -> Tensor:
    return torch.empty_like(x)


def mlp(x: Tensor, d1: Tensor, d2: Tensor, d3: Tensor) -> Tensor:
    """HadamardMLP of x (..., D) through the kernel (where `applies`)."""
    return hadamard_mlp(x.reshape(-1, x.shape[-1]), d1, d2, d3).view(x.shape)
