"""Needle 2 in Flax (linen): parameter for parameter and number for number upstream's decoder-only model.

Module names, scan stacking and dtype promotions follow upstream's `needle/model/architecture.py`
(cactus-needle 2.0.8, described by NEEDLE_V2.md) exactly, because upstream checkpoints load
into this tree and the fixtures were computed by upstream's code. The additions are the
`sow("intermediates", ...)` capture points of the twins' naming contract: no-ops unless the
caller makes "intermediates" mutable, and without parameters. They travel through the layer
scan, so per-layer values come out stacked on axis 0.

Shapes: B batch, T length, D d_model, A attn_dim, H heads, K kv heads, g = H/K query heads per kv head,
h head dim (A/H), L layers, n mHC lanes, G engram sites, N engram tables, P Hadamard width (power of two >= D),
V vocab, c contrastive dim, C pooled cells (T·(L+1)), p probes.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.nn import initializers as jinit

from convert.errors import ConfigError
from convert.v2.config import TransformerConfig
from needle_flax.layers import (
    PROBES,
    ZCRMSNorm,
    apply_rope,
    compute_dtype,
    default_init,
    make_attention_mask,
    make_causal_mask,
    precompute_rope_freqs,
    repeat_kv,
    residual_init,
)
from needle_flax.v2.engram import Engram, engram_indices, engram_masks
from needle_flax.v2.lanes import (
    aq,
    fake_quant_act,
    flat_lanes,
    lane_offsets,
    post_weights,
    pre_weights,
    project,
    read_lanes,
    res_weights,
    rms_unit,
    write_lanes,
)

__all__ = [
    "Attention", "Block", "ConfidenceHead", "ContrastiveHead", "HadamardMLP", "MHCLayer", "SimpleAttentionNetwork",
    "Stack", "aq", "fake_quant_act", "make_window_mask", "next_tokens", "probe_pool", "walsh_matrix",
]

# ----------------------------------------------------------------------------- masks and inputs


def make_window_mask(seq_len: int, window: int, sink=None):
    """(B|1, 1, T, T) bool: key j is within `window` positions of query i (i - j < window), or is a sink.

    sink: (B, T), True (nonzero) on keys every query may see. AND it with a causal mask: this one alone
    also lets a query see the future."""
    pos = jnp.arange(seq_len)
    recent = ((pos[:, None] - pos[None, :]) < window)[None, None, :, :]  # (1, 1, T, T)
    return recent if sink is None else recent | jnp.asarray(sink).astype(jnp.bool_)[:, None, None, :]


def next_tokens(tokens):
    """The MTP head's input ids: tokens shifted left by one, with id 0 appended. (B, T) -> (B, T)."""
    return jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))


# ----------------------------------------------------------------------------- attention


def _dense(features: int, dt, name: str, init=None):
    return nn.Dense(features, dtype=dt, use_bias=False, kernel_init=init or default_init(), name=name)


def _write_kv(k_cache, v_cache, at, k, v):
    """Cached decoding: write this chunk's k, v (B, K, S, h) into the cache variables (L, B, K, M, h) at `at` =
    (layer, pos). The buffers hold k after k_norm and RoPE and v as projected, rounded to the compute dtype (the
    buffers may be float32, holding those values exactly): what the forward attends over."""
    layer, pos = at
    for var, new in ((k_cache, k), (v_cache, v)):
        var.value = jax.lax.dynamic_update_slice(var.value, new[None].astype(var.value.dtype), (layer, 0, 0, pos, 0))


def _grouped_attention(q, k, v, mask, flash: bool):
    """Cached decoding's attention of q (B, H, T, h) over a layer's whole cache k, v (B, K, M, h), mask (B|1, 1, T,
    M): (B, T, H·h) in q's dtype (non-flash: float32, as the forward's).

    The arithmetic of Attention's two paths (flash: jax.nn.dot_product_attention's XLA path step for step;
    non-flash: the explicit softmax), with the query heads grouped per kv head instead of the kv heads repeated,
    because over a long cache XLA:CPU runs the grouped einsums twice as fast as either (27 layers at batch 32:
    0.13 s against 0.25 s flash, 0.18 s non-flash). The sums run in float32 on float32 copies: half-precision
    products are exact in float32, both paths accumulate in float32, and the cache may be float32 (holding
    compute-dtype values) because XLA:CPU converts half precision slowly; the results are rounded to the compute
    dtype wherever the forward rounds them. Only the order of the sums in the dots may differ."""
    B, H, T, h = q.shape
    K, dt = k.shape[1], q.dtype
    qg = q.reshape(B, K, H // K, T, h).astype(jnp.float32)  # (B, K, g, T, h): query head k·g + i reads kv head k
    w = jnp.einsum("bkgth,bkmh->bkgtm", qg, k.astype(jnp.float32))  # (B, K, g, T, M)
    m = mask[:, :, None]  # (B|1, 1, 1, T, M)
    if flash:
        w = jnp.where(m, w * jnp.float32(1.0 / np.sqrt(h)), jnp.float32(-0.7 * jnp.finfo(jnp.float32).max))
        p = jax.nn.softmax(w, axis=-1).astype(dt).astype(jnp.float32)  # rounded to the dtype, as the forward's
        out = jnp.einsum("bkgtm,bkmh->bkgth", p, v.astype(jnp.float32)).astype(dt)  # (B, K, g, T, h)
    else:
        w = w.astype(dt) / jnp.sqrt(jnp.float32(h))  # logits rounded to the dtype, then promoted (§10.13)
        w = jnp.where(m, w, jnp.finfo(w.dtype).min)
        out = jnp.einsum("bkgtm,bkmh->bkgth", nn.softmax(w, axis=-1), v.astype(jnp.float32))  # float32
    return out.reshape(B, H, T, h).transpose(0, 2, 1, 3).reshape(B, T, H * h)  # (B, T, A)


class Attention(nn.Module):
    """GQA self-attention with q/k ZCRMSNorm, RoPE and a sigmoid output gate; flash or explicit softmax (§3.4)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, rope=None, quant=False, cache=None):
        """cache: (layer, pos) for cached decoding (needle_flax.v2.generate), with the "cache" collection holding
        every layer's K/V buffers; the mask then covers all of a buffer's positions."""
        cfg, dt = self.config, compute_dtype(self.config)
        A, H, K, h = cfg.attn_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        B = x.shape[0]

        x = aq(x, quant)
        q = _dense(A, dt, "q_proj")(x)
        k = _dense(K * h, dt, "k_proj")(x)
        v = _dense(K * h, dt, "v_proj")(x)
        q = q.reshape(B, -1, H, h).transpose(0, 2, 1, 3)  # (B, H, T, h)
        k = k.reshape(B, -1, K, h).transpose(0, 2, 1, 3)  # (B, K, T, h)
        v = v.reshape(B, -1, K, h).transpose(0, 2, 1, 3)  # (B, K, T, h)
        q = ZCRMSNorm(dtype=dt, name="q_norm")(q)
        k = ZCRMSNorm(dtype=dt, name="k_norm")(k)
        if rope is not None:
            # The float32 tables promote; upstream casts back to the input dtype.
            q = apply_rope(q, *rope).astype(q.dtype)
            k = apply_rope(k, *rope).astype(k.dtype)
        # upstream's maybe_quant_kv is the identity here: KV_BITS is 0 unless configure_deploy changes it (§5).
        backend = jax.default_backend()
        if cfg.flash and backend == "cpu" and q.dtype == jnp.float16:
            raise ConfigError("config.dtype='float16' with flash=True cannot run on CPU: XLA's CPU dot has no "
                              "float16 -> float32 accumulation (upstream fails the same way); set flash=False "
                              "or use bfloat16")

        if cache is not None:
            k_cache, v_cache = self.variable("cache", "k", None), self.variable("cache", "v", None)
            _write_kv(k_cache, v_cache, cache, k, v)
            k = jax.lax.dynamic_index_in_dim(k_cache.value, cache[0], keepdims=False)  # (B, K, M, h)
            v = jax.lax.dynamic_index_in_dim(v_cache.value, cache[0], keepdims=False)  # (B, K, M, h)
            out = _grouped_attention(q, k, v, mask, cfg.flash)  # (B, T, A)
        elif cfg.flash:
            # cuDNN only for half precision on GPU, as upstream; elsewhere XLA's path (f32 logits and softmax).
            impl = "cudnn" if backend == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) else None
            out = jax.nn.dot_product_attention(
                q.transpose(0, 2, 1, 3),  # (B, T, H, h)
                k.transpose(0, 2, 1, 3),  # (B, T, K, h)
                v.transpose(0, 2, 1, 3),  # (B, T, K, h)
                mask=mask, implementation=impl)
            out = out.reshape(B, -1, A)  # (B, T, A)
        else:
            k, v = repeat_kv(k, H // K), repeat_kv(v, H // K)  # (B, H, T, h), consecutive groups
            # A strongly typed 0-d f32 divisor: bf16 logits are promoted to f32 here (§10.13).
            w = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(h))  # (B, H, T, T)
            if mask is not None:
                w = jnp.where(mask, w, jnp.finfo(w.dtype).min)
            out = jnp.matmul(nn.softmax(w, axis=-1), v)  # (B, H, T, h)
            out = out.transpose(0, 2, 1, 3).reshape(B, -1, A)  # (B, T, A)

        out = out * nn.sigmoid(_dense(A, dt, "gate_proj")(x))  # gated by the already-quantised input
        out = aq(out, quant)
        return _dense(cfg.d_model, dt, "out_proj", residual_init(cfg.num_layers))(out)


# ----------------------------------------------------------------------------- Hadamard MLP


def walsh_matrix(size: int):
    """The normalised Sylvester-Walsh matrix (size a power of two), natural order: symmetric and orthonormal,
    float32 entries ±1/√size (the scale rounded once from float64, as upstream's numpy code does)."""
    if size < 1 or size & (size - 1):
        raise ConfigError(f"walsh_matrix needs a power of two, got {size}; pass config.hada_dim (the smallest power "
                          "of two >= d_model)")
    m = np.ones((1, 1), np.float32)
    while m.shape[0] < size:
        m = np.block([[m, m], [m, -m]])
    return jnp.asarray((m / np.sqrt(size)).astype(np.float32))


class HadamardMLP(nn.Module):
    """out = d3 ⊙ (silu(d2 ⊙ ((d1 ⊙ x)·H))·H), x zero-padded to P and cut back to D: two fixed transforms."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x):
        dt, D, P = compute_dtype(self.config), self.config.d_model, self.config.hada_dim
        walsh = walsh_matrix(P).astype(dt)
        d1 = self.param("d1", jinit.ones, (P,)).astype(dt)
        d2 = self.param("d2", jinit.ones, (P,)).astype(dt)
        d3 = self.param("d3", jinit.constant(0.02), (P,)).astype(dt)
        z = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, P - D)]) if P > D else x  # (B, T, P)
        z = (d1 * z) @ walsh
        z = nn.silu(d2 * z) @ walsh
        return (d3 * z)[..., :D]  # (B, T, D)


# ----------------------------------------------------------------------------- blocks and the lane stack


class Block(nn.Module):
    """Engram injection, then a sandwich-normed gated attention branch and a pre-normed Hadamard MLP branch."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, rope=None, quant=False, engram_kv=None, site_flags=None, cache=None):
        cfg, dt = self.config, compute_dtype(self.config)
        if engram_kv is not None:
            ek, ev = engram_kv  # (G, B, T, D) each
            # Upstream's einsum strings verbatim (s = site), so jnp.einsum plans the contraction the same way.
            alpha = nn.sigmoid(jnp.einsum("btd,sbtd->sbt", rms_unit(x), rms_unit(ek)) / math.sqrt(cfg.d_model))
            # Every site is summed, weighted by whether it belongs to this layer (site_flags (G,)), in f32.
            inject = jnp.einsum("s,sbt,sbtd->btd", site_flags.astype(jnp.float32), alpha,
                                ev.astype(jnp.float32)).astype(x.dtype)
            self.sow(PROBES, "engram_gate", alpha)
            self.sow(PROBES, "engram_inject", inject)
            x = x + inject
        else:  # no engram (mtp_block, or no sites): the contract's empty values
            self.sow(PROBES, "engram_gate", jnp.zeros((0, *x.shape[:2]), jnp.float32))
            self.sow(PROBES, "engram_inject", jnp.zeros_like(x))

        skip = x
        x = ZCRMSNorm(dtype=dt)(x)  # auto-named ZCRMSNorm_0: upstream's param name
        x = Attention(cfg, name="self_attn")(x, mask=mask, rope=rope, quant=quant, cache=cache)
        self.sow(PROBES, "attn_out", x)
        x = ZCRMSNorm(dtype=dt, name="post_attn_norm")(x)
        x = skip + nn.sigmoid(self.param("attn_gate", jinit.zeros, ())).astype(dt) * x

        skip = x
        x = ZCRMSNorm(dtype=dt, name="pre_hada_norm")(x)
        return skip + HadamardMLP(cfg, name="hadamard_mlp")(x)


class MHCLayer(nn.Module):
    """One scanned layer: read the lanes into the block's input u, run the block, write y = block(u) - u back with
    Sinkhorn-mixed lanes (§3.8). `xs` = (site_flags (G,) or None, this layer's routing params and offsets).
    cache: (layer, pos) for cached decoding, passed to the attention (needle_flax.v2.generate applies one layer at a
    time in a lax.scan, with the "cache" collection mutable); None in the forward."""

    config: TransformerConfig
    collect_hidden: bool = False

    @nn.compact
    def __call__(self, x, xs, mask, rope, quant, engram_kv, cache=None):
        dt = compute_dtype(self.config)
        site_flags, hc = xs
        block = Block(self.config, name="block")
        xf = x.astype(jnp.float32)  # (B, T, n, D)
        nx = flat_lanes(x)  # (B, T, n·D)
        r_pre, r_post, r_res = project(nx, (hc["phi_pre"], hc["phi_post"], hc["phi_res"]))
        hpre = pre_weights(r_pre, hc["a_pre"], hc["b_pre"], hc["pre_off"])
        u = read_lanes(hpre, xf, dt)
        # The block keeps its own residuals; subtracting u in dt is upstream's rounding path (§10.6).
        y = block(u, mask=mask, rope=rope, quant=quant, engram_kv=engram_kv, site_flags=site_flags, cache=cache) - u
        hpost = post_weights(r_post, hc["a_post"], hc["b_post"], hc["post_off"])
        hres = res_weights(r_res, hc["a_res"], hc["b_res"])
        new_x = write_lanes(hres, xf, hpost, y, dt)
        for name, value in (("hpre", hpre), ("hpost", hpost), ("hres", hres), ("u", u), ("y", y),
                            ("state", new_x)):
            self.sow(PROBES, name, value)
        return new_x, (jnp.mean(new_x, axis=2) if self.collect_hidden else None)


_ScanBody = MHCLayer  # upstream's name


class Stack(nn.Module):
    """The embedding broadcast to n lanes, L scanned mHC layers, the lane mean and the final norm: (x, hidden)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, rope=None, engram_kv=None, collect_hidden=False, quant=False):
        cfg, dt = self.config, compute_dtype(self.config)
        n, L, nD = cfg.mhc_lanes, cfg.num_layers, cfg.mhc_lanes * cfg.d_model
        x = x.astype(dt)

        site_flags = None
        if engram_kv is not None:
            flags = np.zeros((L, cfg.num_sites), np.float32)  # flags[l, g] = 1 iff site g sits at layer l
            for g, layer in enumerate(cfg.engram_layers):
                flags[layer, g] = 1.0
            site_flags = jnp.asarray(flags)

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
        x = jnp.broadcast_to(x[:, :, None, :], (*x.shape[:2], n, x.shape[-1]))  # (B, T, n, D)

        body = nn.remat(MHCLayer) if cfg.remat else MHCLayer
        layers = nn.scan(
            body,
            variable_axes={"params": 0, PROBES: 0},  # per-layer params and captures stacked on axis 0
            split_rngs={"params": True},
            length=L,
            in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
            unroll=cfg.scan_unroll,
        )
        x, hidden = layers(cfg, collect_hidden, name="layers")(x, (site_flags, hc), mask, rope, quant, engram_kv)
        x = jnp.mean(x, axis=2)  # (B, T, D) in dt
        return ZCRMSNorm(dtype=dt, name="final_norm")(x), hidden


def _res_identity_init(key, shape, dtype=jnp.float32):
    return jnp.broadcast_to(4.0 * jnp.eye(shape[-1], dtype=dtype), shape)


# ----------------------------------------------------------------------------- probe-pooled heads


def probe_pool(cells, probes, keep=None, dtype=jnp.bfloat16):
    """Attention pooling of all cells (B, T, L+1, D) by learned probes (p, D) -> (B, p·D) in `dtype`.

    keep: (B, T), > 0 on tokens whose cells may be pooled. Masked scores are -inf, as upstream: an
    all-pad row therefore gives NaN (§10.4)."""
    B, T, Lc, D = cells.shape
    cells = cells.reshape(B, T * Lc, D)  # (B, C, D) token-major
    scores = jnp.einsum("bcd,kd->bkc", cells.astype(jnp.float32), probes.astype(jnp.float32)) / math.sqrt(D)
    if keep is not None:
        keep = jnp.repeat(keep, Lc, axis=1)  # (B, C)
        scores = jnp.where(keep[:, None, :] > 0, scores, -jnp.inf)
    w = jax.nn.softmax(scores, axis=-1)  # (B, p, C)
    return jnp.einsum("bkc,bcd->bkd", w, cells.astype(jnp.float32)).reshape(B, -1).astype(dtype)  # (B, p·D)


class ContrastiveHead(nn.Module):
    """4 probes, a bias-free projection to c, then L2 normalisation: (p (B, c), log_temp (), raw)."""

    d_model: int
    out_dim: int
    dtype: jnp.dtype = jnp.bfloat16
    temp_init: float = 0.07

    PROBES = 4

    @nn.compact
    def __call__(self, cells, keep=None):
        probes = self.param("probes", default_init(), (self.PROBES, cells.shape[-1]))
        p = nn.Dense(self.out_dim, dtype=self.dtype, use_bias=False, kernel_init=default_init(), name="proj")(
            probe_pool(cells, probes, keep, self.dtype))
        log_temp = self.param("log_temp", jinit.constant(math.log(self.temp_init)), ())
        denom = jnp.sqrt(jnp.sum(p.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + 1e-12)
        return p / denom.astype(p.dtype), log_temp


class ConfidenceHead(nn.Module):
    """8 probes and a Dense with bias to one logit per sequence, (B,) float32."""

    dtype: jnp.dtype = jnp.bfloat16

    PROBES = 8

    @nn.compact
    def __call__(self, cells, keep=None):
        probes = self.param("probes", default_init(), (self.PROBES, cells.shape[-1]))
        logit = nn.Dense(1, dtype=self.dtype, use_bias=True, kernel_init=default_init(), name="proj")(
            probe_pool(cells, probes, keep, self.dtype))
        return logit[..., 0].astype(jnp.float32)


# ----------------------------------------------------------------------------- model


class SimpleAttentionNetwork(nn.Module):
    """Needle 2: engram memory, an mHC lane stack of L layers, tied logits, an MTP head and two probe heads."""

    config: TransformerConfig

    def setup(self):
        cfg, dt = self.config, compute_dtype(self.config)
        self.embedding = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=jinit.normal(stddev=0.02))
        self.embed_scale = math.sqrt(cfg.d_model)
        self.stack = Stack(cfg)
        # setup submodules: their params exist only once a head method has run (upstream's optional groups).
        self.contrastive_head = ContrastiveHead(cfg.d_model, cfg.contrastive_dim, dt)
        self.confidence_head = ConfidenceHead(dt)
        self.engrams = [Engram(cfg) for _ in cfg.engram_layers]  # engrams_0 .. engrams_{G-1}
        self.mtp_combine = nn.Dense(cfg.d_model, dtype=dt, use_bias=False, kernel_init=default_init())
        self.mtp_block = Block(cfg)
        self.mtp_emb_norm = ZCRMSNorm(dtype=dt)
        self.mtp_final_norm = ZCRMSNorm(dtype=dt)

    def _rope(self, seq_len: int):
        return precompute_rope_freqs(self.config.head_dim, seq_len, self.config.rope_theta)

    def _embed(self, tokens):
        # Scaled in the embedding's own dtype (a weakly typed Python float), not yet cast to dt.
        x0 = self.embedding(tokens) * self.embed_scale  # (B, T, D)
        self.sow(PROBES, "embed", x0)
        return x0

    def _logits(self, x, quant, name: str):
        logits = aq(x, quant).astype(jnp.float32) @ self.embedding.embedding.T  # (B, T, V) float32, tied
        self.sow(PROBES, name, logits)
        return logits

    def _engram_kv(self, tokens, mask, quant):
        """(ek, ev), each (G, B, T, D) in dt, for this mask; None without sites."""
        if not self.engrams:
            return None
        indices = engram_indices(tokens, self.config)
        ngram_ok, tap_ok = engram_masks(mask, self.config)
        pairs = [e(indices, ngram_ok, tap_ok, quant=quant) for e in self.engrams]
        ek, ev = jnp.stack([k for k, _ in pairs]), jnp.stack([v for _, v in pairs])  # (G, B, T, D)
        self.sow(PROBES, "engram_k", ek)
        self.sow(PROBES, "engram_v", ev)
        return ek, ev

    def __call__(self, tokens, mask=None, quant=False, return_mtp=False):
        """LM logits (B, T, V) float32; with return_mtp also the MTP head's. mask defaults to causal only."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1])
        x = self._embed(tokens)
        rope = self._rope(tokens.shape[1])
        engram_kv = self._engram_kv(tokens, mask, quant)
        x, _ = self.stack(x, mask=mask, rope=rope, engram_kv=engram_kv, quant=quant)
        self.sow(PROBES, "final_hidden", x)
        logits = self._logits(x, quant, "logits")
        if not (return_mtp or self.is_initializing()):
            return logits

        e2 = self.mtp_emb_norm(self.embedding(next_tokens(tokens)) * self.embed_scale)
        m = self.mtp_combine(aq(jnp.concatenate([x, e2], axis=-1), quant))  # (B, T, 2D) -> (B, T, D)
        m = self.mtp_block(m, mask=mask, rope=rope, quant=quant)
        mtp_logits = self._logits(self.mtp_final_norm(m), quant, "mtp_logits")
        return (logits, mtp_logits) if return_mtp else logits

    def hidden_cells(self, tokens, quant=False, window=0, sink=None):
        """(B, T, L+1, D): the scaled embedding then every layer's lane mean, under causal ∧ padding (∧ window, or
        sink keys). float32 even in bf16, because the embedding is not cast; no final norm."""
        T = tokens.shape[1]
        mask = make_attention_mask(tokens, self.config.pad_token_id)
        if window:
            mask = mask & make_window_mask(T, window, sink)
        x0 = self._embed(tokens)
        engram_kv = self._engram_kv(tokens, mask, quant)
        x, hidden = self.stack(x0, mask=mask, rope=self._rope(T), engram_kv=engram_kv, quant=quant,
                               collect_hidden=True)
        self.sow(PROBES, "final_hidden", x)
        return jnp.stack([x0, *hidden], axis=2)  # (B, T, L+1, D)

    def _cells_and_keep(self, tokens, quant, window, sink):
        cells = jax.lax.stop_gradient(self.hidden_cells(tokens, quant=quant, window=window, sink=sink))
        return cells, (tokens != self.config.pad_token_id).astype(jnp.float32)

    def _encode_contrastive(self, tokens, quant=False, window=0, sink=None):
        """(p (B, c), log_temp ())."""
        p, log_temp = self.contrastive_head(*self._cells_and_keep(tokens, quant, window, sink))
        self.sow(PROBES, "contrastive", p)
        return p, log_temp

    def encode_contrastive(self, tokens, quant=False, window=0, sink=None):
        """The L2-normalised contrastive embedding (B, c)."""
        return self._encode_contrastive(tokens, quant=quant, window=window, sink=sink)[0]

    def forward_contrastive(self, query_tokens, tool_tokens, quant=False):
        """(query embedding, tool embedding, log_temp)."""
        q_emb, log_temp = self._encode_contrastive(query_tokens, quant=quant)
        t_emb, _ = self._encode_contrastive(tool_tokens, quant=quant)
        return q_emb, t_emb, log_temp

    def forward_confidence(self, tokens, quant=False, window=0, sink=None):
        """The confidence logit (B,) float32."""
        logit = self.confidence_head(*self._cells_and_keep(tokens, quant, window, sink))
        self.sow(PROBES, "confidence", logit)
        return logit

    def hidden_states(self, tokens, mask=None):
        """(L, B, T, D) float32: every layer's lane mean, causal mask by default, quant off; no embedding, no final
        norm."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1])
        x = self._embed(tokens)
        engram_kv = self._engram_kv(tokens, mask, False)
        x, hidden = self.stack(x, mask=mask, rope=self._rope(tokens.shape[1]), engram_kv=engram_kv,
                               collect_hidden=True)
        self.sow(PROBES, "final_hidden", x)
        return hidden.astype(jnp.float32)
