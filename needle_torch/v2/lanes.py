"""Needle 2's lane routing (mHC, NEEDLE_V2.md §3.8) and activation fake-quant (§5), as pure torch functions.

The twin of needle_flax/v2/lanes.py. Everything here runs in float32 whatever the compute
dtype: upstream's routing is a float32 island, and the lanes are cast back to the compute
dtype only where upstream casts them (`read_lanes`, `write_lanes`). The fake-quant helpers live here
too because the engram, the attention and the heads all apply them and none of those owns them.

Shapes: B batch, T length, n lanes, D d_model.
"""

from __future__ import annotations

import torch
from torch import Tensor

from needle_torch.fast import cpu_route, cpu_sinkhorn
from needle_torch.fast.kernels import as_reduction, compiling_for_cpu, matmul_nt

RMS_EPS = 1e-6
SINKHORN_ITERS = 20  # upstream runs exactly 20; no tolerance stop
ACT_BITS = 8  # upstream's quantize.ACT_BITS; the config's act_bits is not wired to it (§5)


def rms_unit(x: Tensor) -> Tensor:
    """Upstream's `_rms_unit`: f32(x) * rsqrt(mean(f32(x)^2) + 1e-6) over the last axis; no scale, stays float32.

    A multiply by rsqrt, unlike ZCRMSNorm's division by sqrt (§10.11): keep each form where it belongs."""
    x = x.float()
    return x * rms_factor(x)


def rms_factor(x: Tensor) -> Tensor:
    """rms_unit's factor of float32 x: rsqrt(mean(x^2) + 1e-6) over the last axis, kept (..., 1)."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def _logsumexp(z: Tensor, dim: int) -> Tensor:
    """torch.logsumexp (keepdim). Under torch.compile written out over the n entries of the (short) axis: max +
    log Σ exp(z - max), elementwise, without the guard for an infinite max that finite routing logits never
    reach. Inductor then keeps the 40 steps of a layer's Sinkhorn in fewer buffers: a compiled decode step
    allocates 81 instead of 131 per layer (each a Python call in the step's wrapper; its overhead at the published
    layer count fell from ~4.0 to ~3.4 ms, one thread, noisy). Eagerly it is torch.logsumexp itself."""
    if not torch.compiler.is_compiling():
        return torch.logsumexp(z, dim=dim, keepdim=True)
    parts = z.unbind(dim)
    m = parts[0]
    for p in parts[1:]:
        m = torch.maximum(m, p)
    total = None
    for p in parts:
        e = (p - m).exp()
        total = e if total is None else total + e
    return (m + total.log()).unsqueeze(dim)


def sinkhorn(logits: Tensor, iters: int = SINKHORN_ITERS) -> Tensor:
    """Log-space Sinkhorn over the last two axes: rows then columns, `iters` times, exp at the end (float32).

    Compiled for CPU the (n, n) axes move to the front, so every step runs over the tokens as its innermost,
    contiguous axis (a full vector of tokens per op instead of n = 4 lanes of one token). The same steps in the same
    order, though not bit for bit the old layout's compiled result: 3.0e-7 from eager against 2.4e-7. 2048 tokens'
    Sinkhorn took 2.0-2.1 against 6.1-6.4 ms alone (published lane count, 2 threads): the batch-32 bf16 compiled prefill
    3.9 against 4.1-4.2 s (medians, processes alternating); a decode step, where it fuses into the layer's kernel,
    shows no change. More rows than kernels.REDUCE_MAX_ROWS in a compiled CPU graph take the C++ kernel of
    cpu_sinkhorn instead (the same steps in registers, one op instead of 40 buffers): batch-32 float32 steps 48.5
    against 52.2 ms (medians of 80 pairs alternating in one process, faster in 78 %); in the batch-32 compiled prefill
    the op took 70 ms where the fused kernels shed 153 ms (profiled)."""
    z = logits.float()
    if cpu_sinkhorn.applies(z):  # compiled CPU graphs of many rows: the C++ kernel
        return cpu_sinkhorn.sinkhorn(z, iters)
    moved = compiling_for_cpu(z.device)
    if moved:
        z = z.movedim((-2, -1), (0, 1))  # (n, n, ...): tokens innermost
    rows, cols = (1, 0) if moved else (-1, -2)
    for _ in range(iters):
        z = z - _logsumexp(z, rows)
        z = z - _logsumexp(z, cols)
    z = z.exp()
    return z.movedim((0, 1), (-2, -1)) if moved else z


def lane_offsets(layer: int, lanes: int, device=None) -> tuple[Tensor, Tensor]:
    """(pre_off, post_off), each (n,) float32: +4 / 0 on lane `layer mod n`, -4 on the others."""
    lane = (torch.arange(lanes, device=device) == layer % lanes).float()  # one-hot (n,)
    return 8 * lane - 4, -4 * (1 - lane)


def flat_lanes(lanes: Tensor) -> Tensor:
    """x̂ = rms_unit of the lanes flattened lane-major: (B, T, n, D) -> (B, T, n·D) float32."""
    B, T, n, D = lanes.shape
    return rms_unit(lanes.reshape(B, T, n * D))  # (B, T, n·D)


def project(xhat: Tensor, phis: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """x̂ φ for each φ of `phis` ((out, n·D) Linear weights, used as float32 copies like upstream's), float32 (B, T,
    out) each; a fused multiply-and-sum for few rows under torch.compile (a decode step).

    Eagerly one product per φ, as upstream (and the Flax twin) writes them. Compiled for CPU, one product of the
    stacked weights, so that x̂ is read once rather than once per φ: each column's dot product is the same, its
    float32 sum possibly in another order. At the published size x̂ is 16 MB of float32 per 2048 prompt tokens: the
    compiled float32 prefill of 8 prompts of 256 tokens ran its products in 870-928 against 960-990 ms (54 library
    products fewer), 1.75-1.80 against 1.88-2.12 s in all (medians of 8, processes alternating)."""
    reduce = as_reduction(xhat.shape[:-1].numel(), xhat.device)
    if not compiling_for_cpu(xhat.device):
        return tuple(matmul_nt(xhat, phi, torch.float32, reduce) for phi in phis)
    stacked = torch.cat([phi.float() for phi in phis])  # (Σ out, n·D): 24 rows of 2048 at the published size
    return matmul_nt(xhat, stacked, torch.float32, reduce).split([phi.shape[0] for phi in phis], dim=-1)


def route(lanes: Tensor, phis: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """x̂ φ for each φ of `phis`, x̂ = flat_lanes(lanes): project(flat_lanes(lanes), phis).

    Compiled for CPU over more float32 rows than a fused reduction takes (a prefill, a batch-32 step), the product
    reads the lanes themselves and each row of its result takes rms_unit's factor after it, x̂ φ = (x φ)·rsqrt(mean(x²)
    + ε): the same function up to float32 rounding (the factor applied to the n·D inputs of a row or to its sums),
    without writing x̂ (16 MB of float32 per 2048 tokens at the published size) and reading it back. Published size, 2
    threads of a 2-core Zen 4 EPYC, the two forms alternating in one process: the batch-32 float32 compiled prefill
    3.99 against 4.38 s (medians of 8, faster in 7); batch-32 steps 46.4 against 46.8 ms (60 pairs, even). Not for
    bf16 lanes, which the product would read as a float32 copy: the batch-32 bf16 prefill took 3.87-3.91 against
    3.28-3.79 s (medians, two processes each, alternating). bf16 lanes with bf16 weights there take the C++ kernel of
    cpu_route instead where the CPU has the AVX512-BF16 dot products (the same form, the sums on the bf16 units: the
    batch-32 bf16 compiled prefill 2344-2378 against 2487-2637 ms, best of 3, alternating in one process)."""
    B, T, n, D = lanes.shape
    if cpu_route.applies(lanes, phis):  # compiled CPU graphs of many bf16 rows: the C++ kernel
        return cpu_route.route(lanes, phis)
    if lanes.dtype != torch.float32 or not compiling_for_cpu(lanes.device) or as_reduction(B * T, lanes.device):
        return project(flat_lanes(lanes), phis)
    x = lanes.reshape(B, T, n * D)
    stacked = torch.cat([phi.float() for phi in phis])  # (Σ out, n·D)
    return (matmul_nt(x, stacked, torch.float32) * rms_factor(x)).split([phi.shape[0] for phi in phis], dim=-1)


def pre_weights(r: Tensor, a: Tensor, b: Tensor, pre_off: Tensor) -> Tensor:
    """hpre = σ(a·r + b + pre_off) with r = x̂ φ_pre, (B, T, n) float32 (a bf16 0-d `a` or bf16 `b` promote to
    float32)."""
    return torch.sigmoid(a * r + b + pre_off)


def post_weights(r: Tensor, a: Tensor, b: Tensor, post_off: Tensor) -> Tensor:
    """hpost = 2·σ(a·r + b + post_off) with r = x̂ φ_post, (B, T, n) float32."""
    return 2 * torch.sigmoid(a * r + b + post_off)


def res_weights(r: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """hres = Sinkhorn(a·R + b) with R = r = x̂ φ_res reshaped row-major to (n, n): (B, T, n, n) float32."""
    n = b.shape[-1]
    R = r.reshape(*r.shape[:-1], n, n)  # (B, T, n, n): R[i, j] = column i·n + j
    return sinkhorn(a * R + b)


def read_lanes(hpre: Tensor, lanes: Tensor, dtype: torch.dtype) -> Tensor:
    """u = cast_dtype(Σ_i hpre_i · f32(X_i)): (B, T, n), (B, T, n, D) -> (B, T, D)."""
    return (hpre[..., None] * lanes.float()).sum(2).to(dtype)  # (B, T, n, 1) * (B, T, n, D), summed over n


def write_lanes(hres: Tensor, lanes: Tensor, hpost: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """X'_i = cast_dtype(Σ_j M_ij · f32(X_j) + hpost_i · f32(y)): the new lanes (B, T, n, D).

    Eagerly a batched (n, n) x (n, D) product per token. Compiled for CPU the n terms are written out, so the
    mix fuses with its neighbours into one pass over the lanes (the same function up to the order of the float32
    sum): the library's batch of tiny products took 26.9 ms a layer in the batch-32 f32 prefill (0.73 s of
    9.3 s)."""
    xf = lanes.float()
    if compiling_for_cpu(lanes.device):
        mixed = sum(hres[..., :, j, None] * xf[:, :, None, j, :] for j in range(xf.shape[2]))  # (B, T, n, D)
    else:
        mixed = hres @ xf
    return (mixed + hpost[..., None] * y.float()[:, :, None, :]).to(dtype)  # (B, T, n, D)


# ----------------------------------------------------------------------------- activation fake-quant (§5)


def fake_quant_act(x: Tensor, bits: int = ACT_BITS) -> Tensor:
    """Per-row symmetric fake-quant over the last axis, straight-through: the forward value is q.

    In float32: scale = max|x| / (2^(b-1) - 1) (1 for an all-zero row), q = clip(round(x / scale), -2^(b-1),
    2^(b-1) - 1) · scale with round half to even (torch.round, like jnp.round); then x + (q - x) with the
    difference detached, in x's dtype, exactly as upstream writes it."""
    qmax = 2 ** (bits - 1) - 1
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)  # (..., 1)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    q = (torch.clamp(torch.round(xf / scale), -qmax - 1, qmax) * scale).to(x.dtype)
    return x + (q - x).detach()


def aq(x: Tensor, quant: bool | Tensor) -> Tensor:
    """Upstream's `aq`: the identity for quant=False, fake_quant_act otherwise (a bool or a 0-d bool tensor)."""
    if quant is False:
        return x
    if isinstance(quant, Tensor):
        return torch.where(quant, fake_quant_act(x), x)
    return fake_quant_act(x) if quant else x


__all__ = [
    "ACT_BITS", "SINKHORN_ITERS", "aq", "fake_quant_act", "flat_lanes", "lane_offsets", "read_lanes", "write_lanes",
    "post_weights", "pre_weights", "project", "res_weights", "rms_factor", "rms_unit", "route", "sinkhorn",
]
