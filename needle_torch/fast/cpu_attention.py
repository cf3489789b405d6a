"""Torch-only speed code: a decode step's attention over a K/V cache as one C++ kernel, for compiled CPU steps.

The kernel (csrc/decode_attention.cpp) computes what model.dot_product_attention's flash path computes for one
query per row: float32 logits, float32 softmax with masked keys at a large finite negative, probabilities rounded to
the cache dtype, p·v summed in float32 and rounded once (the same function up to the order of the float32 sums;
in bf16 it gave the torch form's results bit for bit on random inputs). It is built through inductor's own C++
toolchain and cache (the compiler a compiled CPU step needs anyway), once per (dtype, query heads per kv head, head
dim), and enters compiled graphs as the custom op `needle_twin::decode_attention`.

Why: fused torch ops read the cache with one horizontal sum per key and query head; the kernel streams each
(row, kv head)'s keys and values once and skips the masked ones. It costs a call, hence MIN_UNITS.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import Tensor

from needle_torch.fast.kernels import CPP_SCALARS, build_once, cpp_kernel, enabled

# Rows x kv heads from which a compiled step calls the kernel instead of fusing the attention into the layer (batch 8
# at the published size's 4 kv heads; batch 4 measured even).
MIN_UNITS = 32
# The head dim must fill whole float vectors (the kernel's static_assert): 16 lanes with AVX-512, 8 with AVX2.
HEAD_MULTIPLE = 16
_SOURCE = Path(__file__).with_name("csrc") / "decode_attention.cpp"
_built: dict[str, object] = {}  # _key(dtype, group, head) -> the kernel
_ready: dict[str, bool] = {}  # the same keys -> built (False: it did not); plain values, which compiled graphs guard on


def _key(dtype: torch.dtype, group: int, head: int) -> str:
    return f"{dtype}/{group}/{head}"


def takes(units: int) -> bool:
    """Whether a step over `units` rows x kv heads is large enough for the kernel (MIN_UNITS)."""
    return units >= MIN_UNITS


def _build(dtype: torch.dtype, group: int, head: int):
    scalar = CPP_SCALARS[dtype]
    argtypes = ["const float*", f"const {scalar}*", f"const {scalar}*", "const bool*", f"{scalar}*", "int64_t",
                "int64_t", "int64_t", "float", "float"]
    return cpp_kernel(_SOURCE, (("SCALAR", scalar), ("GROUP", group), ("HEAD", head)), argtypes)


def prepare(dtype: torch.dtype, group: int, head: int, device: torch.device, units: int) -> None:
    """Build the kernel a compiled step over `units` rows x kv heads in `dtype` with these heads will call, if it
    takes one (before compiling: the build runs eagerly, and a failure leaves the fused form in place with one
    kernels.KernelBuildWarning)."""
    if not enabled() or not takes(units) or device.type != "cpu" or dtype not in CPP_SCALARS or head % HEAD_MULTIPLE:
        return
    build_once(_key(dtype, group, head), lambda: _build(dtype, group, head), _built, _ready,
               "CPU decode attention kernel", "compiled steps use the fused torch form (same function, slower at "
               "large batches)")


def applies(q: Tensor, k: Tensor, flash: bool) -> bool:
    """Whether this attention (q (B, H, T, h), k (B, K, S, h)) runs through the kernel: one query per row, flash
    arithmetic, CPU, a built kernel, at least MIN_UNITS rows x kv heads."""
    B, H, T, h = q.shape
    K = k.shape[1]
    return flash and T == 1 and q.device.type == "cpu" and takes(B * K) and _ready.get(_key(k.dtype, H // K, h), False)


@torch.library.custom_op("needle_twin::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, masked: float) -> Tensor:
    """q (B, K, G, h), k and v (B, K, M, h) in one dtype, mask (B, M) bool -> (B, K, G, h) in v's dtype: each query
    head attends over its kv head's keys where mask holds (prepare() first)."""
    B, K, G, h = q.shape
    kernel = _built[_key(k.dtype, G, h)]
    out = torch.empty(q.shape, dtype=v.dtype)
    kernel(q.float().contiguous(), k.contiguous(), v.contiguous(), mask.contiguous(), out, B, K, k.shape[2], scale,
           masked)
    return out


@decode_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, masked: float) -> Tensor:
    return torch.empty(q.shape, dtype=v.dtype, device=q.device)


def attend(q: Tensor, k: Tensor, v: Tensor, keep: Tensor, masked: float) -> Tensor:
    """q (B, H, 1, h), k and v (B, K, M, h), keep (B, M) bool -> (B, H, 1, h) in v's dtype through the kernel: the
    flash attention of model.dot_product_attention (scale 1/√h, hidden keys' logits at `masked`) for one query."""
    B, H, T, h = q.shape
    K = k.shape[1]
    return decode_attention(q.reshape(B, K, H // K, h), k, v, keep, 1 / math.sqrt(h), masked).view(B, H, T, h)
