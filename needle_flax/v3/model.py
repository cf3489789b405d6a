"""Needle 3 in Flax (linen): parameter for parameter and number for number upstream's laddered decoder.

Module names, the layer scan and every dtype promotion follow upstream's `needle/model/architecture.py`
(cactus-needle 3.2.8, NEEDLE_V3.md), because upstream checkpoints load into this tree unchanged and the goldens
were computed by upstream's code. `quant=True` is upstream's deploy numerics with the config's act_bits and
kv_bits (what `configure_deploy(cfg.act_bits, cfg.kv_bits)` sets globally there).

Shapes: B batch, T length, D d_model, H heads, K kv heads, hq qk head dim, hv v head dim, F = max(hq, hv),
τ conv taps, L layers, n mHC lanes, G engram sites, N engram tables, s sub dim, P Hadamard width (power of two
>= D), (a, b) Monarch factor sizes (a·b = P), V vocab, k probes, Q queries, L1 = L+1 cell rows, c embedding dim.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.nn import initializers as jinit

from convert.errors import ConfigError
from convert.v3.config import ENGRAM_TAPS, HADA_COND_RANK, TransformerConfig, hada_perms, walsh_matrix
from convert.v3.ladder import ladder_layer_ranks
from needle_flax.layers import (
    PROBES,
    ZCRMSNorm,
    apply_rope,
    compute_dtype,
    default_init,
    make_causal_mask,
    make_padding_mask,
    precompute_rope_freqs,
    repeat_kv,
    residual_init,
)
from needle_flax.v2.lanes import (
    SINKHORN_ITERS,
    flat_lanes,
    lane_offsets,
    post_weights,
    pre_weights,
    project,
    read_lanes,
    rms_unit,
    write_lanes,
)
from needle_flax.v3.engram import engram_indices, shift_right
from needle_flax.v3.quant import _fake_quant, head_weight, quant_kv, quant_query


def _sinkhorn(logits, iters: int = SINKHORN_ITERS):
    """Doubly stochastic (..., n, n): rows then columns normalised in log space, `iters` times, then exp.

    Unrolled, as upstream writes it, rather than lanes.sinkhorn's fori_loop: the two differ by an ulp, and an ulp
    flips an A8 rounding step under quant=True (quant logits moved by 3e-3 relative on the fixture)."""
    for _ in range(iters):
        logits = logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
        logits = logits - jax.nn.logsumexp(logits, axis=-2, keepdims=True)
    return jnp.exp(logits)


def _aq(x, quant, bits: int):
    """Activation fake-quant to `bits` (config.act_bits) per row where `quant` says so; 0 bits: off."""
    if quant is False or not bits:
        return x
    return jax.lax.cond(quant, lambda t: _fake_quant(t, bits), lambda t: t, x)


# ----------------------------------------------------------------------------- masks and shifts


def make_window_mask(seq_len: int, window: int):
    """(1, 1, T, T) bool band: key j is fewer than `window` positions before query i (i - j < window). AND it with
    a causal mask: alone it also lets a query see the future."""
    pos = jnp.arange(seq_len)
    return ((pos[:, None] - pos[None, :]) < window)[None, None, :, :]  # (1, 1, T, T)


def mask_diag(mask, offset: int):
    """diag_o[b, t] = mask[b, 0, t, t - o], 0 where t < o: may position t see position t - o? (B|1, T)."""
    m = mask[:, 0]  # (B|1, T, T)
    T = m.shape[-1]
    if offset >= T:
        return jnp.zeros(m.shape[:-2] + (T,), m.dtype)
    d = jnp.diagonal(m, offset=-offset, axis1=-2, axis2=-1)  # (B|1, T - o)
    return d if offset == 0 else jnp.pad(d, ((0, 0), (offset, 0)))


# ----------------------------------------------------------------------------- engram


def _taps_init(key, shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype).at[0].set(1.0)  # identity conv: only the current position


class Engram(nn.Module):
    """One engram site: gather the hashed rows, project to key and value, then a causal dilated 4-tap conv on v."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, indices, ngram_ok, tap_ok, quant=False):
        cfg, dt = self.config, compute_dtype(self.config)
        N, s, D = cfg.num_engram_tables, cfg.engram_sub_dim, cfg.d_model
        tables = self.param("embedding", default_init(), (N, cfg.engram_slots, s))
        fetched = tables[jnp.arange(N), indices] * ngram_ok[..., None]  # (B, T, N, s)
        e = fetched.reshape(*indices.shape[:2], N * s)  # (B, T, N·s) table-major
        e = _aq(e.astype(dt), quant, cfg.act_bits)
        k = nn.Dense(D, dtype=dt, use_bias=False, kernel_init=default_init(), name="key_proj")(e)
        v = nn.Dense(D, dtype=dt, use_bias=False, kernel_init=residual_init(cfg.num_layers), name="value_proj")(e)
        taps = self.param("taps", _taps_init, (ENGRAM_TAPS, D)).astype(dt)
        # Python's sum (0 + tap 0 + tap 1 ...) is upstream's order of additions.
        v = sum(taps[j] * shift_right(v, j * cfg.engram_dilation) * tap_ok[j][..., None] for j in range(ENGRAM_TAPS))
        return k, v


# ----------------------------------------------------------------------------- attention


def conv_taps(z, taps, tap_ok):
    """Causal depthwise conv over time on projected channels z (B, T, C): Σ_j taps[j] ⊙ z[t - j] · ok_j[t].
    taps (τ, C); tap_ok (τ, B|1, T) in z's dtype, or None (no mask); tap 0 is never masked, not even on pads."""
    out = 0
    for j in range(taps.shape[0]):
        shifted = shift_right(z, j)  # (B, T, C)
        if j and tap_ok is not None:
            shifted = shifted * tap_ok[j][..., None]
        out = out + taps[j] * shifted
    return out


def _dense(features: int, dt, name: str, init=None):
    return nn.Dense(features, dtype=dt, use_bias=False, kernel_init=init or default_init(), name=name)


class MultiHeadAttention(nn.Module):
    """GQA self-attention with split head dims: conv taps on q/k/v, q/k ZCRMSNorm and RoPE over hq, flash (padded
    to F) or an explicit softmax, and a sigmoid output gate over hv (§3.2)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, rope=None, quant=False):
        cfg, dt = self.config, compute_dtype(self.config)
        H, K, D, tau = cfg.num_heads, cfg.num_kv_heads, cfg.d_model, cfg.qkv_conv_taps
        hq, hv = cfg.head_dims
        B = x.shape[0]

        x = _aq(x, quant, cfg.act_bits)
        q = _dense(H * hq, dt, "q_proj")(x)  # (B, T, H·hq)
        k = _dense(K * hq, dt, "k_proj")(x)  # (B, T, K·hq)
        v = _dense(K * hv, dt, "v_proj")(x)  # (B, T, K·hv)
        for name, value in (("q", q), ("k", k), ("v", v)):
            self.sow(PROBES, name, value)
        if tau:
            taps = [self.param(f"{p}_taps", _taps_init, (tau, w)).astype(dt)
                    for p, w in (("q", H * hq), ("k", K * hq), ("v", K * hv))]
            # The layer's own mask (window or global) decides which past positions a tap may read.
            tap_ok = None if mask is None else jnp.stack([mask_diag(mask, j) for j in range(tau)]).astype(q.dtype)
            q, k, v = (conv_taps(z, t, tap_ok) for z, t in zip((q, k, v), taps, strict=True))
            for name, value in (("q_conv", q), ("k_conv", k), ("v_conv", v)):
                self.sow(PROBES, name, value)

        q = q.reshape(B, -1, H, hq).transpose(0, 2, 1, 3)  # (B, H, T, hq)
        k = k.reshape(B, -1, K, hq).transpose(0, 2, 1, 3)  # (B, K, T, hq)
        v = v.reshape(B, -1, K, hv).transpose(0, 2, 1, 3)  # (B, K, T, hv)
        q = ZCRMSNorm(dtype=dt, name="q_norm")(q)
        k = ZCRMSNorm(dtype=dt, name="k_norm")(k)
        if rope is not None:
            # The float32 tables promote; upstream casts back to the input dtype.
            q = apply_rope(q, *rope).astype(q.dtype)
            k = apply_rope(k, *rope).astype(k.dtype)
        q = quant_query(q, quant, cfg)
        k, v = quant_kv(k, quant, cfg), quant_kv(v, quant, cfg)

        if cfg.flash:
            # One fused head dim F for q, k and v: q pre-scaled by √(F/hq) in dt (1.15625 in bf16 for 64/48) so
            # that the kernel's 1/√F makes 1/√hq; zero padding changes no dot product.
            F = max(hq, hv)
            qf = q * jnp.asarray(math.sqrt(F / hq), q.dtype)
            if F > hq:
                qf = jnp.pad(qf, ((0, 0), (0, 0), (0, 0), (0, F - hq)))  # (B, H, T, F)
                k = jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, F - hq)))  # (B, K, T, F)
            vf = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, F - hv))) if F > hv else v  # (B, K, T, F)
            # cuDNN only for half precision on GPU, as upstream; elsewhere XLA's path (f32 logits and softmax).
            impl = "cudnn" if jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else None
            out = jax.nn.dot_product_attention(
                qf.transpose(0, 2, 1, 3),  # (B, T, H, F)
                k.transpose(0, 2, 1, 3),  # (B, T, K, F)
                vf.transpose(0, 2, 1, 3),  # (B, T, K, F)
                mask=mask, implementation=impl)
            out = out[..., :hv].reshape(B, -1, H * hv)  # (B, T, H·hv)
        else:
            k, v = repeat_kv(k, H // K), repeat_kv(v, H // K)  # (B, H, T, hq), (B, H, T, hv): consecutive groups
            # A strongly typed 0-d f32 divisor: bf16 logits are promoted to f32 here.
            w = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(hq))  # (B, H, T, T)
            if mask is not None:
                w = jnp.where(mask, w, jnp.finfo(w.dtype).min)
            out = jnp.matmul(nn.softmax(w, axis=-1), v)  # (B, H, T, hv)
            out = out.transpose(0, 2, 1, 3).reshape(B, -1, H * hv)  # (B, T, H·hv)

        out = out * nn.sigmoid(_dense(H * hv, dt, "gate_proj")(x))  # gated by the already-quantised input
        out = _aq(out, quant, cfg.act_bits)
        return _dense(D, dt, "out_proj", residual_init(cfg.num_layers))(out)


# ----------------------------------------------------------------------------- Monarch Hadamard MLP


def kron_apply(z, a, b):
    """z (..., P) -> z·(A⊗B), computed as Aᵀ·Z·B on the row-major (a, b) view Z of each row."""
    lead = z.shape[:-1]
    z = z.reshape(*lead, a.shape[0], b.shape[0])  # (..., a, b)
    z = jnp.einsum("...ij,ik,jl->...kl", z, a, b)  # (..., a, b)
    return z.reshape(*lead, a.shape[0] * b.shape[0])  # (..., P)


def _walsh_init(size: int):
    return lambda key, shape, dtype=jnp.float32: jnp.asarray(walsh_matrix(size), dtype)


class HadamardMLP(nn.Module):
    """Three learned Kronecker factor pairs (Walsh at init) between two fixed permutations, five vectors and a
    rank-8 softmax conditioning from the unpadded input (§3.3); everything in dt."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        cfg, dt = self.config, compute_dtype(self.config)
        D, P = cfg.d_model, cfg.hada_dim
        a, b = cfg.hada_blocks
        p1, p2 = (jnp.asarray(p) for p in hada_perms(P, bool(cfg.ladder_widths)))
        factors = [(self.param(f"w{i}a", _walsh_init(a), (a, a)).astype(dt),
                    self.param(f"w{i}b", _walsh_init(b), (b, b)).astype(dt)) for i in (1, 2, 3)]
        d1 = self.param("d1", jinit.ones, (P,)).astype(dt)
        d2 = self.param("d2", jinit.ones, (P,)).astype(dt)
        b2 = self.param("b2", jinit.zeros, (P,)).astype(dt)
        d3 = self.param("d3", jinit.ones, (P,)).astype(dt)
        d4 = self.param("d4", jinit.constant(0.02), (P,)).astype(dt)
        cond_v = self.param("cond_v", default_init(), (D, HADA_COND_RANK)).astype(dt)
        cond_u = self.param("cond_u", jinit.zeros, (HADA_COND_RANK, P)).astype(dt)

        cond = 1 + nn.softmax(x @ cond_v, axis=-1) @ cond_u  # (B, T, 8) -> (B, T, P)
        z = jnp.pad(x, ((0, 0), (0, 0), (0, P - D))) if P > D else x  # (B, T, P)
        z = kron_apply(d1 * z, *factors[0])[..., p1]
        z = kron_apply(nn.silu(d2 * cond * z + b2), *factors[1])[..., p2]  # (d2 ⊙ cond) ⊙ z, left to right
        z = kron_apply(d3 * z, *factors[2])
        return (d4 * z)[..., :D]  # (B, T, D)


# ----------------------------------------------------------------------------- blocks and the lane stack


class Block(nn.Module):
    """Engram injection, then a sandwich-normed gated attention branch and a pre-normed Monarch MLP branch."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, rope=None, quant=False, engram_kv=None, site_flags=None):
        cfg, dt = self.config, compute_dtype(self.config)
        if engram_kv is not None:
            ek, ev = engram_kv  # (G, B, T, D) each
            # Upstream's einsum strings verbatim (s = site), so jnp.einsum plans the contraction the same way.
            alpha = nn.sigmoid(jnp.einsum("btd,sbtd->sbt", rms_unit(x), rms_unit(ek)) / math.sqrt(cfg.d_model))
            self.sow(PROBES, "engram_gate", alpha)  # (G, B, T)
            # Every site is summed, weighted by whether it belongs to this layer (site_flags (G,)), in f32.
            x = x + jnp.einsum("s,sbt,sbtd->btd", site_flags.astype(jnp.float32), alpha,
                               ev.astype(jnp.float32)).astype(x.dtype)

        skip = x
        x = ZCRMSNorm(dtype=dt)(x)  # auto-named ZCRMSNorm_0: upstream's param name
        x = MultiHeadAttention(cfg, name="self_attn")(x, mask=mask, rope=rope, quant=quant)
        self.sow(PROBES, "attn_out", x)
        x = ZCRMSNorm(dtype=dt, name="post_attn_norm")(x)
        x = skip + nn.sigmoid(self.param("attn_gate", jinit.zeros, ())).astype(dt) * x

        skip = x
        x = ZCRMSNorm(dtype=dt, name="pre_hada_norm")(x)
        x = HadamardMLP(cfg, name="hadamard_mlp")(x)
        self.sow(PROBES, "mlp_out", x)
        return skip + x


class MHCLayer(nn.Module):
    """One scanned layer (upstream's `_ScanBody`, scanned as "layers"): read the lanes into the block's input, run
    the block, write y = block(u) - u back with Sinkhorn-mixed lanes. `xs` = (site_flags (G,) or None, global
    flag, this layer's routing params and offsets, ladder rank). In capture mode the carry is (X, X_sub) and
    X_sub advances only on layers of rank < exit_depth; subnetwork_only carries X_sub alone."""

    config: TransformerConfig
    collect_hidden: bool = False
    capture_subnetwork: bool = False
    subnetwork_only: bool = False

    @nn.compact
    def __call__(self, carry, xs, mask, local_mask, rope, quant, engram_kv, exit_depth):
        cfg, dt, n = self.config, compute_dtype(self.config), self.config.mhc_lanes
        x, sub_x = carry if self.capture_subnetwork else (carry, None)
        site_flags, gflag, hc, rank = xs
        if local_mask is not None:
            mask = jnp.where(gflag > 0, mask, local_mask)  # this layer's mask: global or windowed
        block = Block(cfg, name="block")

        def advance(stream, pre_off, post_off, block_module):
            self.sow(PROBES, "lanes_in", stream)
            xf = stream.astype(jnp.float32)  # (B, T, n, D)
            nx = _aq(flat_lanes(stream), quant, cfg.act_bits)  # (B, T, n·D): one A8 group over the whole row
            r_pre, r_post, r_res = project(nx, (hc["phi_pre"], hc["phi_post"], hc["phi_res"]))
            hpre = pre_weights(r_pre, hc["a_pre"], hc["b_pre"], pre_off)  # (B, T, n)
            u = read_lanes(hpre, xf, dt)  # (B, T, D)
            # The block keeps its own residuals; subtracting u in dt is upstream's rounding path.
            y = block_module(u, mask=mask, rope=rope, quant=quant, engram_kv=engram_kv, site_flags=site_flags) - u
            hpost = post_weights(r_post, hc["a_post"], hc["b_post"], post_off)
            hres = _sinkhorn(hc["a_res"] * r_res.reshape(*r_res.shape[:-1], n, n) + hc["b_res"])  # (B, T, n, n)
            out = write_lanes(hres, xf, hpost, y, dt)  # (B, T, n, D)
            for name, value in (("hpre", hpre), ("u", u), ("hpost", hpost), ("hres", hres), ("lanes_out", out)):
                self.sow(PROBES, name, value)
            return out

        def advance_sub(mdl, stream):
            return advance(stream, hc["sub_pre_off"], hc["sub_post_off"], mdl)

        def pass_through(_mdl, stream):
            return stream

        if self.subnetwork_only:
            x = nn.cond(rank < exit_depth, advance_sub, pass_through, block, x)
        else:
            x = advance(x, hc["pre_off"], hc["post_off"], block)
        if self.capture_subnetwork:
            sub_x = nn.cond(rank < exit_depth, advance_sub, pass_through, block, sub_x)
            return (x, sub_x), (jnp.mean(sub_x, axis=2) if self.collect_hidden else None)
        return x, (jnp.mean(x, axis=2) if self.collect_hidden else None)


def _res_identity_init(key, shape, dtype=jnp.float32):
    return jnp.broadcast_to(4.0 * jnp.eye(shape[-1], dtype=dtype), shape)


class Stack(nn.Module):
    """The embedding broadcast to n lanes, L scanned mHC layers, the lane mean and the final norm.

    Returns (x, hidden), or (x, hidden, x_sub) in capture mode (exit_depth without subnetwork_only), where hidden
    holds the sub-stream's lane means; subnetwork_only returns the sub-stream as x."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, rope=None, engram_kv=None, collect_hidden=False, quant=False,
                 exit_depth=None, subnetwork_only=False):
        cfg, dt = self.config, compute_dtype(self.config)
        n, L, nD = cfg.mhc_lanes, cfg.num_layers, cfg.mhc_lanes * cfg.d_model
        x = x.astype(dt)
        if subnetwork_only and exit_depth is None:
            raise ConfigError("subnetwork_only needs an exit_depth: pass the rung depth d (2 <= d <= num_layers)")

        site_flags = None
        if engram_kv is not None:
            flags = np.zeros((L, cfg.num_sites), np.float32)  # flags[l, g] = 1 iff site g sits at layer l
            for g, layer in enumerate(cfg.engram_layers):
                flags[layer, g] = 1.0
            site_flags = jnp.asarray(flags)

        local_mask, gflags = None, jnp.zeros((L,), jnp.float32)
        if cfg.sliding_window and mask is not None:
            local_mask = mask & make_window_mask(x.shape[1], cfg.sliding_window)  # (B|1, 1, T, T)
            gflags = jnp.asarray([1.0 if i in cfg.global_layers else 0.0 for i in range(L)])

        pre_off, post_off = lane_offsets(L, n)
        hc = {
            "phi_pre": self.param("mhc_phi_pre", default_init(), (L, nD, n)),
            "phi_post": self.param("mhc_phi_post", default_init(), (L, nD, n)),
            "phi_res": self.param("mhc_phi_res", default_init(), (L, nD, n * n)),
            "b_pre": self.param("mhc_b_pre", jinit.zeros, (L, n)),
            "b_post": self.param("mhc_b_post", jinit.zeros, (L, n)),
            "b_res": self.param("mhc_b_res", _res_identity_init, (L, n, n)),
            "a_pre": self.param("mhc_a_pre", jinit.constant(0.01), (L,)),
            "a_post": self.param("mhc_a_post", jinit.constant(0.01), (L,)),
            "a_res": self.param("mhc_a_res", jinit.constant(0.01), (L,)),
            "pre_off": jnp.asarray(pre_off),
            "post_off": jnp.asarray(post_off),
        }
        ranks = jnp.asarray(ladder_layer_ranks(cfg), jnp.int32)  # (L,)
        if exit_depth is None:
            hc["sub_pre_off"], hc["sub_post_off"] = hc["pre_off"], hc["post_off"]
        else:
            # The sub-stream's lane of layer l: its ascending position among the active layers, mod n.
            position = jnp.cumsum((ranks < exit_depth).astype(jnp.int32)) - 1  # (L,)
            sub_lane = jax.nn.one_hot(jnp.mod(position, n), n, dtype=jnp.float32)  # (L, n)
            hc["sub_pre_off"], hc["sub_post_off"] = 8 * sub_lane - 4, -4 * (1 - sub_lane)

        x = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], n, x.shape[-1]))  # (B, T, n, D)
        capture = exit_depth is not None and not subnetwork_only
        body = nn.remat(MHCLayer) if cfg.remat else MHCLayer
        layers = nn.scan(
            body,
            variable_axes={"params": 0, PROBES: 0},  # per-layer params and captures stacked on axis 0
            split_rngs={"params": True},
            metadata_params={nn.PARTITION_NAME: "layers"},
            length=L,
            unroll=cfg.scan_unroll,
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
        )
        carry, hidden = layers(cfg, collect_hidden, capture, subnetwork_only, name="layers")(
            (x, x) if capture else x, (site_flags, gflags, hc, ranks), mask, local_mask, rope, quant, engram_kv,
            jnp.int32(0) if exit_depth is None else exit_depth)

        final_norm = ZCRMSNorm(dtype=dt, name="final_norm")
        if capture:
            # One norm over both streams stacked on the batch axis, as upstream (not bit-equal to two calls).
            both = final_norm(jnp.concatenate([jnp.mean(s, axis=2) for s in carry], axis=0))  # (2B, T, D)
            x, sub_x = jnp.split(both, 2, axis=0)  # (B, T, D) each
            return x, hidden, sub_x
        x = final_norm(jnp.mean(carry, axis=2))  # (B, T, D)
        self.sow(PROBES, "final_hidden", x)
        return x, hidden


# ----------------------------------------------------------------------------- probe-pooled heads


def probe_pool(cells, keep, probes, gain, query, bias, row_keep=None, dtype=jnp.bfloat16):
    """Two-stage attention pooling, float32, of cells (B, T, L1, D) -> (B, Q·D) in `dtype`.

    Each cell row l has k probes that pool over the tokens (keep (B, T) > 0; masked scores are -inf, so an
    all-pad row gives NaN, as upstream); the pooled vectors are RMS-normalised and scaled by gain (L1, k); then Q
    queries pool over the L1·k vectors (flattened l-major) with row_bias (Q, L1, k), rows with row_keep (L1,) = 0
    excluded."""
    cf = cells.astype(jnp.float32)
    B, T, L1, D = cf.shape
    k, Q = probes.shape[1], query.shape[0]
    e = jnp.einsum("btld,lkd->blkt", cf, probes.astype(jnp.float32)) / math.sqrt(D)  # (B, L1, k, T)
    if keep is not None:
        e = jnp.where(keep[:, None, None, :] > 0, e, -jnp.inf)
    r = jnp.einsum("blkt,btld->blkd", jax.nn.softmax(e, axis=-1), cf)  # (B, L1, k, D)
    r = rms_unit(r) * gain.astype(jnp.float32)[None, :, :, None]
    u = (jnp.einsum("blkd,qd->bqlk", r, query.astype(jnp.float32)) / math.sqrt(D)
         + bias.astype(jnp.float32)[None])  # (B, Q, L1, k)
    if row_keep is not None:
        u = jnp.where(row_keep[None, None, :, None] > 0, u, -jnp.inf)
    w = jax.nn.softmax(u.reshape(B, Q, L1 * k), axis=-1)  # (B, Q, L1·k)
    pooled = jnp.einsum("bqm,bmd->bqd", w, r.reshape(B, L1 * k, D))  # (B, Q, D)
    return pooled.reshape(B, Q * D).astype(dtype)  # (B, Q·D) q-major


class HeadProjection(nn.Module):
    """y = x·W (+ bias), W (Q·D, out), in `dtype`; under quant W is CQ-4 along its input axis."""

    features: int
    use_bias: bool = True
    dtype: jnp.dtype = None

    @nn.compact
    def __call__(self, x, quant=False):
        kernel = head_weight(self.param("kernel", default_init(), (x.shape[-1], self.features)), quant,
                             reduce_second_last=True)
        if self.dtype is not None:
            x, kernel = x.astype(self.dtype), kernel.astype(self.dtype)
        y = x @ kernel  # (B, out)
        if self.use_bias:
            bias = self.param("bias", jinit.zeros, (self.features,))
            y = y + (bias.astype(self.dtype) if self.dtype is not None else bias)
        return y


class ProbeHead(nn.Module):
    """A probe-pooled head over the cells: its probes, gains, queries and row biases, then `proj` to out_dim
    logits, (B, out_dim) float32. Subclasses name the head (its config fields `<name>_probes|queries`)."""

    config: TransformerConfig

    key = ""
    out_dim = 0

    def pooled(self, cells, keep, row_keep, quant=False):
        """(B, Q·D) in dt; probes and query CQ-4 along D under quant."""
        name = self.key.removesuffix("_head")
        L1, D = cells.shape[2], cells.shape[3]
        k, Q = getattr(self.config, f"{name}_probes"), getattr(self.config, f"{name}_queries")
        out = probe_pool(cells, keep,
                         head_weight(self.param("probes", default_init(), (L1, k, D)), quant),
                         self.param("gain", jinit.ones, (L1, k)),
                         head_weight(self.param("query", default_init(), (Q, D)), quant),
                         self.param("row_bias", jinit.zeros, (Q, L1, k)),
                         row_keep, compute_dtype(self.config))
        self.sow(PROBES, "pooled", out)
        return out

    @nn.compact
    def __call__(self, cells, keep=None, row_keep=None, quant=False):
        y = HeadProjection(self.out_dim, dtype=compute_dtype(self.config), name="proj")(
            self.pooled(cells, keep, row_keep, quant), quant)
        return y.astype(jnp.float32)


class EmbeddingHead(ProbeHead):
    """A bias-free projection to c, L2-normalised in dt: (p (B, c), log_temp (), bias ()); the two scalars are
    training-only (not exported)."""

    key = "embedding_head"
    temp_init = 10.0
    bias_init = -10.0

    @nn.compact
    def __call__(self, cells, keep=None, row_keep=None, quant=False):
        p = HeadProjection(self.config.embedding_dim, use_bias=False, dtype=compute_dtype(self.config),
                           name="proj")(self.pooled(cells, keep, row_keep, quant), quant)
        log_temp = self.param("log_temp", jinit.constant(math.log(self.temp_init)), ())
        bias = self.param("bias", jinit.constant(self.bias_init), ())
        denom = jnp.sqrt(jnp.sum(p.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + 1e-12)  # (B, 1)
        return p / denom.astype(p.dtype), log_temp, bias


class ConfidenceHead(ProbeHead):
    """One logit per sequence."""

    key, out_dim = "confidence_head", 1


class RouterHead(ProbeHead):
    """Three router logits per sequence."""

    key, out_dim = "router_head", 3


# ----------------------------------------------------------------------------- model


class SimpleAttentionNetwork(nn.Module):
    """Needle 3: engram memory, an mHC lane stack of L layers with nested depth rungs, tied logits (optionally the
    first out_vocab rows) and three probe heads."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        self.embedding = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=jinit.normal(stddev=0.02))
        self.embed_scale = math.sqrt(cfg.d_model)
        self.stack = Stack(cfg)
        # setup submodules: their params exist only once a head method has run (upstream's optional groups).
        self.embedding_head = EmbeddingHead(cfg)
        self.confidence_head = ConfidenceHead(cfg)
        self.router_head = RouterHead(cfg)
        self.engrams = [Engram(cfg) for _ in cfg.engram_layers]  # engrams_0 .. engrams_{G-1}

    def _rope(self, seq_len: int):
        return precompute_rope_freqs(self.config.head_dims[0], seq_len, self.config.rope_theta)

    def _embed(self, tokens):
        # Scaled in the embedding's own dtype (a weakly typed Python float), not yet cast to dt.
        return self.embedding(tokens) * self.embed_scale  # (B, T, D)

    def _engram_kv(self, tokens, mask, quant):
        """(ek, ev), each (G, B, T, D) in dt, with validity from this (full, never windowed) mask; None without
        sites."""
        if not self.engrams:
            return None
        cfg = self.config
        indices = engram_indices(tokens, cfg)
        ngram_ok = jnp.stack([mask_diag(mask, o - 1) for o in cfg.engram_orders
                              for _ in range(cfg.engram_heads_resolved)], axis=-1)  # (B|1, T, N)
        tap_ok = jnp.stack([mask_diag(mask, j * cfg.engram_dilation) for j in range(ENGRAM_TAPS)])  # (4, B|1, T)
        pairs = [e(indices, ngram_ok, tap_ok, quant=quant) for e in self.engrams]
        return jnp.stack([k for k, _ in pairs]), jnp.stack([v for _, v in pairs])  # (G, B, T, D) each

    def _logits(self, x, quant):
        head = self.embedding.embedding  # tied, in its stored dtype
        if self.config.out_vocab:
            head = head[: self.config.out_vocab]  # (V_out, D): the input lookup keeps all V rows
        return _aq(x, quant, self.config.act_bits).astype(jnp.float32) @ head.T  # (B, T, V_out)

    def __call__(self, tokens, mask=None, quant=False, exit_depth=None, exit_only=False, subnetwork_only=False):
        """LM logits (B, T, V_out) float32; with exit_depth d (logits, exit logits of rung d), or only the exit
        logits (exit_only), or only rung d's own logits computed alone (subnetwork_only). mask defaults to causal."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1])
        x0 = self._embed(tokens)
        self.sow(PROBES, "embed", x0)
        engram_kv = self._engram_kv(tokens, mask, quant)
        if engram_kv is not None:
            self.sow(PROBES, "engram_k", engram_kv[0])
            self.sow(PROBES, "engram_v", engram_kv[1])
        out = self.stack(x0, mask=mask, rope=self._rope(tokens.shape[1]), engram_kv=engram_kv,
                         quant=quant, exit_depth=exit_depth, subnetwork_only=subnetwork_only)
        if subnetwork_only or exit_depth is None:
            return self._logits(out[0], quant)
        exit_logits = self._logits(out[2], quant)
        return exit_logits if exit_only else (self._logits(out[0], quant), exit_logits)

    def hidden_cells(self, tokens, quant=False, window=0, sink=None, exit_depth=None):
        """(B, T, L1, D): the scaled embedding then every layer's lane mean (the rung's sub-stream with exit_depth),
        under causal ∧ padding (∧ window, or sink (B, T) keys); no final norm."""
        T = tokens.shape[1]
        mask = make_causal_mask(T) & make_padding_mask(tokens, self.config.pad_token_id)
        if window:
            recent = make_window_mask(T, window)
            mask = mask & (recent if sink is None else recent | sink[:, None, None, :])
        x0 = self._embed(tokens)
        engram_kv = self._engram_kv(tokens, mask, quant)
        hidden = self.stack(x0, mask=mask, rope=self._rope(T), engram_kv=engram_kv, quant=quant,
                            collect_hidden=True, exit_depth=exit_depth)[1]  # (L, B, T, D)
        return jnp.stack([x0, *hidden], axis=2)  # (B, T, L1, D)

    def _head_inputs(self, tokens, quant, window, sink, exit_depth):
        """(cells, keep (B, T), row_keep (L1,) or None): with exit_depth only x0's row and the rung's layers."""
        cells = jax.lax.stop_gradient(self.hidden_cells(tokens, quant, window, sink, exit_depth))
        keep = (tokens != self.config.pad_token_id).astype(jnp.float32)
        row_keep = None
        if exit_depth is not None:
            active = (jnp.asarray(ladder_layer_ranks(self.config)) < exit_depth).astype(jnp.float32)  # (L,)
            row_keep = jnp.concatenate([jnp.ones((1,), jnp.float32), active])  # (L1,)
        return cells, keep, row_keep

    def forward_embedding(self, tokens, quant=False, window=0, sink=None, exit_depth=None):
        """The L2-normalised embedding (B, c) in dt."""
        return self.embedding_head(*self._head_inputs(tokens, quant, window, sink, exit_depth), quant=quant)[0]

    def forward_confidence(self, tokens, quant=False, window=0, sink=None, exit_depth=None):
        """The confidence logit (B,) float32."""
        return self.confidence_head(*self._head_inputs(tokens, quant, window, sink, exit_depth), quant=quant)[..., 0]

    def forward_router(self, tokens, quant=False, window=0, sink=None, exit_depth=None):
        """The router logits (B, 3) float32."""
        return self.router_head(*self._head_inputs(tokens, quant, window, sink, exit_depth), quant=quant)

    def hidden_states(self, tokens, mask=None):
        """(L, B, T, D) float32: every layer's lane mean, causal mask by default, quant off; no embedding, no final
        norm."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1])
        engram_kv = self._engram_kv(tokens, mask, False)
        _, hidden = self.stack(self._embed(tokens), mask=mask, rope=self._rope(tokens.shape[1]),
                               engram_kv=engram_kv, collect_hidden=True)
        return hidden.astype(jnp.float32)
