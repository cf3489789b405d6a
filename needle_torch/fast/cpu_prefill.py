"""Torch-only speed code: a cached prefill's causal attention as one C++ kernel, for compiled CPU graphs.

The kernel (csrc/prefill_attention.cpp) computes what model.dot_product_attention computes for a causal float32
prefill through SDPA, in blocks of model.QUERY_BLOCK queries: per block the keys up to its last query, logits
q·kᵀ/√h plus the additive mask (0 or float32's lowest), softmax, p·v; the weights normalised after p·v, the same
function up to the order of the float32 operations. Its bf16 build computes the twin's bf16 flash attention (float32
logits and softmax of the bf16 q and k, the weights rounded to bf16, p·v summed in float32 and rounded once), for
compiled bf16 prefills where the CPU has no bf16 units (kernels.upcasts), which would otherwise run it as float32
library products on upcast copies over every key of every query, and where it has the AVX512-BF16 dot products but
no AMX tiles (_dots), there summing q·k and p·v on those dot products. It is built through inductor's own C++ toolchain
and cache, once per (dtype, query heads per kv head, head dim), and enters compiled graphs as the custom op
`needle_twin::prefill_attention`.

Why: torch's CPU flash kernel runs a prefill block's shapes well below the CPU's float32 peak; the kernel computes
the logits and p·v as register tiles sized to the build's vector registers (32 with AVX-512, 16 in AVX2 code), the
query heads of a kv head sharing every key and value load.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from needle_torch.fast.kernels import CPP_SCALARS, build_once, cpp_kernel, enabled, graph_calls, product_path, upcasts

# The head dim must fill whole float vectors (the kernel's static_assert): 16 lanes with AVX-512, 8 with AVX2.
HEAD_MULTIPLE = 16
_SOURCE = Path(__file__).with_name("csrc") / "prefill_attention.cpp"
_built: dict[str, object] = {}  # _key(group, head, dtype) -> the kernel
_ready: dict[str, bool] = {}  # the same keys -> built (False: it did not); plain values, which compiled graphs guard on


def _key(group: int, head: int, dtype: torch.dtype = torch.float32) -> str:
    return f"{group}/{head}/{'bf16' if dtype == torch.bfloat16 else 'f32'}"  # traced code: no dict lookup on a dtype


def _build(group: int, head: int, dtype: torch.dtype):
    scalar = CPP_SCALARS[dtype]
    argtypes = [f"const {scalar}*"] * 3 + ["const float*", f"{scalar}*"] + ["int64_t"] * 6 + ["float"] + ["int64_t"] * 2
    return cpp_kernel(_SOURCE, (("SCALAR", scalar), ("GROUP", group), ("HEAD", head)), argtypes)


@torch.compiler.assume_constant_result
def _dots() -> bool:
    """Whether bf16 builds run on the CPU's AVX512-BF16 dot products (kernels.product_path 1: bf16 units, no AMX
    tiles). A constant to torch.compile."""
    return product_path(torch.bfloat16) == 1


def _takes(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether compiled prefills in `dtype` on `device` call the kernel: float32; bf16 where the CPU has no bf16
    units (kernels.upcasts: there the twin's bf16 attention would run as float32 library products on upcast copies,
    over every key of every query); and bf16 where it has the AVX512-BF16 dot products and no AMX tiles (_dots:
    the kernel's dot-product form against SDPA's fused bf16 kernel, see above). With AMX tiles a compiled bf16
    prefill keeps SDPA's fused kernel, whose products can use them (not measured here)."""
    return device.type == "cpu" and (dtype == torch.float32 or (
        dtype == torch.bfloat16 and (upcasts(dtype, device) or _dots())))


def prepare(group: int, head: int, dtype: torch.dtype, device: torch.device) -> None:
    """Build the kernel compiled prefills with these heads in `dtype` will call (before compiling: the build runs
    eagerly, and a failure leaves SDPA or the explicit attention in place with one kernels.KernelBuildWarning)."""
    if not enabled() or not _takes(dtype, device) or head % HEAD_MULTIPLE:
        return
    build_once(_key(group, head, dtype), lambda: _build(group, head, dtype), _built, _ready,
               "CPU prefill attention kernel", "compiled prefills keep the torch attention (same function, slower)")


def applies(q: Tensor, k: Tensor, causal: bool, flash: bool = True) -> bool:
    """Whether this attention (q (B, H, T, h), k (B, K, S, h)) runs through the kernel: causal (the T queries the
    last T of the S keys), a compiled CPU graph, inference, float32 (either path: they are one function) or bf16's
    flash path where the CPU has no bf16 units (see _takes), a built kernel."""
    H, h = q.shape[1], q.shape[3]
    return (causal and q.dtype == k.dtype and _takes(q.dtype, q.device) and (flash or q.dtype == torch.float32)
            and graph_calls(q.device, _ready, _key(H // k.shape[1], h, q.dtype)))


def _rows(t: Tensor) -> Tensor:
    """t (B, K, S, h) with its keys' rows contiguous (the kernel's layout: b·stride(0) + kk·stride(1) + j·h)."""
    return t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous()


@torch.library.custom_op("needle_twin::prefill_attention", mutates_args=())
def prefill_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, qblock: int) -> Tensor:
    """q (B, T, H, h), k and v (B, K, S, h) in one dtype (float32 or bf16), bias (B, T, S) float32 -> (B, T, H, h) in
    q's dtype: query t attends the keys up to S - T + t with the additive bias, in blocks of `qblock` queries
    (prepare() first)."""
    B, T, H, h = q.shape
    K, S = k.shape[1], k.shape[2]
    k, v = _rows(k), _rows(v)
    if k.stride()[:2] != v.stride()[:2]:
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    _built[_key(H // K, h, q.dtype)](q.contiguous(), k, v, bias.float().expand(B, T, S).contiguous(), out, B, K, T, S,
                                     k.stride(0), k.stride(1), 1 / math.sqrt(h), qblock, int(_dots()))
    return out


@prefill_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, qblock: int) -> Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def attend(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, qblock: int) -> Tensor:
    """q (B, H, T, h), k and v (B, K, S, h), float32 bias (B|1, 1, T, S) -> (B, H, T, h) through the kernel (a view of
    its (B, T, H, h) output, which the attention's output projection reads as it is)."""
    return prefill_attention(q.transpose(1, 2), k, v, bias[:, 0], qblock).transpose(1, 2)
