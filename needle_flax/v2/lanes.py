"""Needle 2's residual lanes (mHC, NEEDLE_V2.md §3.8) as pure functions, plus the activation fake-quant (§5).

The lane routing of one layer, written out so that the scan body (`model.MHCLayer`), a cached
decoder and the tests can share one definition. The routing is float32 whatever the compute
dtype (§3.1): only `read_lanes` and `write_lanes` cast their result to dt.
`fake_quant_act`/`aq` live here, not in model.py, because the engram (engram.py) quantises
its input too and model.py imports engram.py, never the reverse.

Shapes: B batch, T length, n lanes, D d_model, L layers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

RMS_EPS = 1e-6
SINKHORN_ITERS = 20  # upstream's fixed count: no tolerance stop (§10.5)
ACT_BITS = 8  # upstream's quantize.ACT_BITS default; the config's act_bits is not wired to it (§5)


def rms_unit(x, epsilon: float = RMS_EPS):
    """Unscaled RMS normalisation in float32: x * rsqrt(mean(x²) + eps), no cast back (unlike ZCRMSNorm, which
    divides by sqrt and has a scale; §10.11)."""
    xf = x.astype(jnp.float32)
    return xf * jax.lax.rsqrt(jnp.mean(xf**2, axis=-1, keepdims=True) + epsilon)


def sinkhorn(logits, iters: int = SINKHORN_ITERS):
    """Doubly stochastic matrices over the last two axes, in log space: each iteration normalises the rows (last
    axis), then the columns; exp at the end.

    Upstream unrolls the iterations in Python. We run the same steps in a fori_loop because XLA's CPU fusion
    recomputes an unrolled chain from its input inside every fused kernel: ~4 s of compile per layer body
    (seconds per jit of the model) against 0.2 s. The values agree with the unrolled form to float32
    rounding (1 ulp where they differ), as upstream's own eager and jitted runs do with each other."""

    def step(_, log_k):
        log_k = log_k - jax.nn.logsumexp(log_k, axis=-1, keepdims=True)
        return log_k - jax.nn.logsumexp(log_k, axis=-2, keepdims=True)

    return jnp.exp(jax.lax.fori_loop(0, iters, step, logits))


def lane_offsets(num_layers: int, lanes: int):
    """(pre_off, post_off), each (L, n) float32: layer l favours lane l mod n (+4 into the block, 0 out of it) over
    the others (-4 each way)."""
    lane = np.eye(lanes, dtype=np.float32)[np.arange(num_layers) % lanes]  # (L, n) one-hot
    return 8 * lane - 4, -4 * (1 - lane)


def flat_lanes(x):
    """x̂ = rms_unit of the lanes flattened lane-major, (B, T, n, D) -> (B, T, n·D) float32."""
    B, T, n, D = x.shape
    return rms_unit(x.reshape(B, T, n * D))  # (B, T, n·D)


def project(nx, phis):
    """nx φ for each φ of `phis` ((n·D, out) kernels, used as float32 copies), float32 (B, T, out) each: one
    product per φ, as upstream writes them (the torch twin stacks the φ into one product; same columns)."""
    return tuple(nx @ phi.astype(jnp.float32) for phi in phis)


def pre_weights(r, a_pre, b_pre, pre_off):
    """hpre (B, T, n) from r = nx φ_pre: how much of each lane the block reads."""
    return jax.nn.sigmoid(a_pre * r + b_pre + pre_off)


def post_weights(r, a_post, b_post, post_off):
    """hpost (B, T, n) from r = nx φ_post: how much of the block's update each lane receives, in (0, 2)."""
    return 2 * jax.nn.sigmoid(a_post * r + b_post + post_off)


def res_weights(r, a_res, b_res):
    """hres (B, T, n, n) from r = nx φ_res: the doubly stochastic lane-to-lane mixing; row i says what lane i keeps
    of lane j."""
    n = b_res.shape[-1]
    res = r.reshape(*r.shape[:-1], n, n)  # (B, T, n, n) row-major
    return sinkhorn(a_res * res + b_res)


def read_lanes(hpre, xf, dtype):
    """u = Σ_i hpre_i · X_i, (B, T, D) in dt: the block's input."""
    return jnp.einsum("btn,btnc->btc", hpre, xf).astype(dtype)


def write_lanes(hres, xf, hpost, y, dtype):
    """X'_i = Σ_j hres_ij · X_j + hpost_i · y, (B, T, n, D) in dt: the next layer's lanes."""
    mixed = jnp.einsum("btij,btjc->btic", hres, xf)  # (B, T, n, D)
    return (mixed + hpost[..., None] * y.astype(jnp.float32)[:, :, None, :]).astype(dtype)


# ----------------------------------------------------------------------------- activation fake-quant (§5)


def fake_quant_act(x, bits: int = ACT_BITS):
    """Symmetric per-row fake quant over the whole last axis: scale absmax/qmax (1 where absmax is 0),
    half-to-even rounding, clip to [-qmax-1, qmax]; straight-through, so the gradient is the identity."""
    qmax = 2 ** (bits - 1) - 1
    g = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(g), axis=-1, keepdims=True)
    scale = jnp.where(absmax > 0, absmax / qmax, 1.0)
    q = (jnp.clip(jnp.round(g / scale), -qmax - 1, qmax) * scale).astype(x.dtype)
    return x + jax.lax.stop_gradient(q - x)


def aq(x, quant):
    """Activation fake-quant where `quant` (a Python or traced bool) says so; the literal False costs nothing."""
    if quant is False:
        return x
    return jax.lax.cond(quant, fake_quant_act, lambda t: t, x)
