"""Torch-only speed code: Needle 2's lane-routing projections over many rows of bf16 lanes as one C++ kernel, for
compiled CPU graphs on CPUs with the AVX512-BF16 dot products.

The kernel (csrc/lane_route.cpp) computes lanes.route's function, x̂ φᵀ for the stacked φ_pre, φ_post and φ_res with
x̂ = rms_unit(x) over the flattened lanes, as (x φᵀ)·rsqrt(mean(x²) + 1e-6): the compiled float32 form's order (the
factor after the sums). The lanes and the φ weights of a bf16 model hold bf16 values, so each product x_i·φ_i is exact
in float32 and the CPU's bf16 dot products add them up in float32: upstream's float32 function up to the order of its
sums and where the factor applies, like the float32 form. It is built through inductor's own C++ toolchain and cache
once per (n·D, Σ out), and enters compiled graphs as the custom op `needle_twin::lane_route`.

Why: compiled, bf16 lanes took a fused pass writing x̂ as float32 (16 MB per 2048 tokens at the published size) and a
float32 library product reading it back; here each row of lanes is read once, as bf16, and its 24 sums run on the
bf16 units at twice the float32 rate. 2048 rows of 4 x 512 (a prefill chunk at the published size), 2 threads of a
2-core Zen 4 EPYC: 0.63 ms, where the compiled torch form took a 0.70 ms fused pass and a 1.48 ms product; the
batch-32 bf16 compiled prefill of 256-token prompts 2344-2378 against 2487-2637 ms (best of 3 a round, the two forms
alternating in one process).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from needle_torch.fast.kernels import REDUCE_MAX_ROWS, build_once, cpp_kernel, graph_calls, product_path

# The kernel's widths: its rows in steps of 32 bf16 values (one dot-product vector), its outputs in blocks of 4.
WIDTH_MULTIPLE, OUTS_MULTIPLE = 32, 4
_SOURCE = Path(__file__).with_name("csrc") / "lane_route.cpp"
_built: dict[str, object] = {}  # _key(width, outs) -> the kernel
_ready: dict[str, bool] = {}  # the same keys -> built (False: it did not); plain values, which compiled graphs guard on


def _key(width: int, outs: int) -> str:
    return f"{width}/{outs}"


def _build(width: int, outs: int):
    return cpp_kernel(_SOURCE, (("WIDTH", width), ("OUTS", outs)),
                      ["const c10::BFloat16*", "const c10::BFloat16*", "float*", "int64_t"])


def prepare(lanes: int, d_model: int, dtype: torch.dtype, device: torch.device) -> None:
    """Build the kernel compiled graphs of bf16 lanes of this shape will call, where the CPU has the bf16 dot
    products (kernels.product_path) (before compiling: the build runs eagerly, and a failure leaves the torch form in
    place with one kernels.KernelBuildWarning)."""
    width, outs = lanes * d_model, 2 * lanes + lanes * lanes
    if (device.type != "cpu" or dtype != torch.bfloat16 or product_path(dtype) < 1 or width % WIDTH_MULTIPLE
            or outs % OUTS_MULTIPLE):
        return
    build_once(_key(width, outs), lambda: _build(width, outs), _built, _ready, "CPU lane-routing kernel",
               "compiled graphs use the torch form (same function, slower)")


def applies(lanes: Tensor, phis: tuple[Tensor, ...]) -> bool:
    """Whether the routing of lanes (B, T, n, D) by phis runs through the kernel: a compiled CPU graph, bf16 lanes
    and weights, more rows than kernels.REDUCE_MAX_ROWS (fewer stay one fused reduction), inference, a built
    kernel."""
    B, T, n, D = lanes.shape
    return (lanes.dtype == torch.bfloat16 and all(phi.dtype == torch.bfloat16 for phi in phis)
            and B * T > REDUCE_MAX_ROWS
            and graph_calls(lanes.device, _ready, _key(n * D, sum(phi.shape[0] for phi in phis))))


@torch.library.custom_op("needle_twin::lane_route", mutates_args=())
def lane_route(x: Tensor, phi: Tensor) -> Tensor:
    """x (R, I) bf16, phi (O, I) bf16 -> (R, O) float32: rms_unit(x) φᵀ (prepare() first)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0], phi.shape[0]), dtype=torch.float32)
    _built[_key(x.shape[1], phi.shape[0])](x, phi.contiguous(), out, x.shape[0])
    return out


@lane_route.register_fake
def _(x: Tensor, phi: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], phi.shape[0]), dtype=torch.float32)


def route(lanes: Tensor, phis: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """lanes.route through the kernel (where `applies`): x̂ φ for each φ of phis, float32 (B, T, out) each."""
    B, T, n, D = lanes.shape
    stacked = torch.cat(phis)  # (Σ out, n·D) bf16
    out = lane_route(lanes.reshape(B * T, n * D), stacked).view(B, T, -1)
    return out.split([phi.shape[0] for phi in phis], dim=-1)
