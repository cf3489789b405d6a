"""Needle 2's lane routing (mHC, NEEDLE_V2.md §3.8) and activation fake-quant (§5), as pure torch functions.

The twin of needle_flax/v2/lanes.py. Everything here runs in float32 whatever the compute
dtype: upstream's routing is a float32 island, and the lanes are cast back to the compute
dtype only where upstream casts them (`read_lanes`, `write_lanes`). The fake-quant helpers live here
too because the engram, the attention and the heads all apply them and none of those owns them.

Shapes: B batch, T length, n lanes, D d_model, L layers.
"""

from __future__ import annotations

import torch
from torch import Tensor

RMS_EPS = 1e-6
SINKHORN_ITERS = 20  # upstream runs exactly 20; no tolerance stop
ACT_BITS = 8  # upstream's quantize.ACT_BITS; the config's act_bits is not wired to it (§5)


def rms_unit(x: Tensor) -> Tensor:
    """Upstream's `_rms_unit`: f32(x) * rsqrt(mean(f32(x)^2) + 1e-6) over the last axis; no scale, stays float32.

    A multiply by rsqrt, unlike ZCRMSNorm's division by sqrt (§10.11): keep each form where it belongs."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def sinkhorn(logits: Tensor, iters: int = SINKHORN_ITERS) -> Tensor:
    """Log-space Sinkhorn over the last two axes: rows then columns, `iters` times, exp at the end (float32)."""
    z = logits.float()
    for _ in range(iters):
        z = z - torch.logsumexp(z, dim=-1, keepdim=True)  # rows sum to 1
        z = z - torch.logsumexp(z, dim=-2, keepdim=True)  # columns sum to 1
    return z.exp()


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
    out) each: one product per φ, as upstream writes them."""
    return tuple(xhat.float() @ phi.float().T for phi in phis)  # (B, T, n·D) @ (n·D, out)


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
    """X'_i = cast_dtype(Σ_j M_ij · f32(X_j) + hpost_i · f32(y)): the new lanes (B, T, n, D)."""
    mixed = hres @ lanes.float()  # (B, T, n, n) @ (B, T, n, D): one (n, n) x (n, D) product per token
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
    "post_weights", "pre_weights", "project", "res_weights", "rms_unit", "sinkhorn",
]
