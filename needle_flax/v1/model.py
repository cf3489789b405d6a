"""Needle v1 in Flax (linen): parameter-for-parameter and number-for-number the upstream model.

Module names, scan stacking and dtype promotions follow upstream's
`needle/model/architecture.py` exactly, because upstream checkpoints are loaded
into this tree and `parity_tests` compares it against the golden fixtures.
The one addition is `sow("intermediates", ...)` probes: they are no-ops unless
the caller makes "intermediates" mutable, and they carry no parameters.

Shapes: B batch, S source length, T target length, D d_model, H heads, K kv heads, G = H/K query heads per kv
head, h head dim, F d_ff, V vocab, L layers, C contrastive dim.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.nn import initializers as jinit

from convert.v1.config import TransformerConfig
from needle_flax.layers import (
    PROBES,
    ZCRMSNorm,
    apply_rope,
    compute_dtype,
    default_init,
    make_attention_mask,
    make_padding_mask,
    precompute_rope_freqs,
    repeat_kv,
    residual_init,
)

# ----------------------------------------------------------------------------- attention


class MultiHeadAttention(nn.Module):
    num_heads: int
    num_kv_heads: int
    d_model: int
    num_layers: int
    dtype: jnp.dtype = jnp.bfloat16
    rope_keys_only: bool = False
    decode: bool = False  # incremental self-attention with a float32 K/V cache
    cache_len: int = 0
    cross_cache: bool = False  # project cross-attention K/V once, reuse afterwards

    def _dense(self, features, name, init=None):
        return nn.Dense(features, dtype=self.dtype, use_bias=False, kernel_init=init or default_init(), name=name)

    def _project_kv(self, kv_input):
        B, h = kv_input.shape[0], self.d_model // self.num_heads
        k = self._dense(self.num_kv_heads * h, "k_proj")(kv_input)
        v = self._dense(self.num_kv_heads * h, "v_proj")(kv_input)
        k = k.reshape(B, -1, self.num_kv_heads, h).transpose(0, 2, 1, 3)  # (B, K, S, h)
        v = v.reshape(B, -1, self.num_kv_heads, h).transpose(0, 2, 1, 3)  # (B, K, S, h)
        return ZCRMSNorm(dtype=self.dtype, name="k_norm")(k), v

    @nn.compact
    def __call__(self, q_input, kv_input, mask=None, rope=None, cache_pos=None, cross_prefill=True):
        B, h = q_input.shape[0], self.d_model // self.num_heads

        q = self._dense(self.d_model, "q_proj")(q_input)
        q = q.reshape(B, -1, self.num_heads, h).transpose(0, 2, 1, 3)  # (B, H, T, h)
        q = ZCRMSNorm(dtype=self.dtype, name="q_norm")(q)
        if rope is not None and not self.rope_keys_only:
            q = apply_rope(q, *rope)

        if self.cross_cache:
            kv_shape = (B, self.num_kv_heads, kv_input.shape[1], h)
            cross_k = self.variable("cache", "cross_k", jnp.zeros, kv_shape, self.dtype)
            cross_v = self.variable("cache", "cross_v", jnp.zeros, kv_shape, self.dtype)
            if cross_prefill:
                cross_k.value, cross_v.value = self._project_kv(kv_input)
            k, v = cross_k.value, cross_v.value
        else:
            k, v = self._project_kv(kv_input)
            if rope is not None:
                k = apply_rope(k, *rope)
            if self.decode:
                # Cache kept in float32 so the cached path matches the uncached one exactly.
                cache_shape = (B, self.num_kv_heads, self.cache_len, h)
                cached_k = self.variable("cache", "cached_key", jnp.zeros, cache_shape, jnp.float32)
                cached_v = self.variable("cache", "cached_value", jnp.zeros, cache_shape, jnp.float32)
                zero = jnp.array(0, jnp.int32)
                at = (zero, zero, jnp.asarray(cache_pos, jnp.int32), zero)
                cached_k.value = jax.lax.dynamic_update_slice(cached_k.value, k.astype(jnp.float32), at)
                cached_v.value = jax.lax.dynamic_update_slice(cached_v.value, v.astype(jnp.float32), at)
                k, v = cached_k.value, cached_v.value  # (B, K, cache_len, h)

        repeats = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, repeats), repeat_kv(v, repeats)  # (B, H, S, h)

        # A strongly typed f32 scale: scores are float32 whatever the compute dtype.
        scores = jnp.matmul(q, k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(h))  # (B, H, T, S)
        if mask is not None:
            scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
        probs = nn.softmax(scores, axis=-1)
        out = jnp.matmul(probs, v)  # (B, H, T, h)
        out = out.transpose(0, 2, 1, 3).reshape(B, -1, self.d_model)  # (B, T, D)
        return self._dense(self.d_model, "out_proj", residual_init(self.num_layers))(out)


class FeedForward(nn.Module):
    d_model: int
    d_ff: int
    num_layers: int
    dtype: jnp.dtype = jnp.bfloat16
    activation: str = "drelu"

    @nn.compact
    def __call__(self, x, ffn_mask=None):
        dense = lambda n, name, init=None: nn.Dense(  # noqa: E731
            n, dtype=self.dtype, use_bias=False, kernel_init=init or default_init(), name=name
        )
        gate = dense(self.d_ff, "gate_proj")(x)  # (B, T, F)
        up = dense(self.d_ff, "up_proj")(x)  # (B, T, F)
        if self.activation == "swiglu":
            hidden = nn.silu(gate) * up
        elif self.activation == "geglu":
            hidden = nn.gelu(gate) * up  # flax's default gelu: the tanh approximation
        else:  # drelu
            hidden = nn.relu(gate) * nn.relu(up)
        if ffn_mask is not None:
            hidden = hidden * ffn_mask[:, None, :]
        return dense(self.d_model, "down_proj", residual_init(self.num_layers))(hidden)


# ----------------------------------------------------------------------------- blocks


def _gate(module: nn.Module, name: str, dtype):
    return nn.sigmoid(module.param(name, jinit.zeros, ())).astype(dtype)


class EncoderBlock(nn.Module):
    """Pre-norm self-attention (+ optional FFN), each added through a sigmoid gate."""

    num_heads: int
    num_kv_heads: int
    d_model: int
    d_ff: int
    num_layers: int
    dtype: jnp.dtype = jnp.bfloat16
    activation: str = "drelu"
    dropout_rate: float = 0.0
    no_feedforward: bool = True

    @nn.compact
    def __call__(self, x, mask=None, rope=None, ffn_mask=None, deterministic=True):
        gate = _gate(self, "attn_gate", self.dtype)
        y = ZCRMSNorm(dtype=self.dtype)(x)
        a = MultiHeadAttention(
            self.num_heads, self.num_kv_heads, self.d_model, self.num_layers, self.dtype, name="self_attn"
        )(y, y, mask=mask, rope=rope)
        self.sow(PROBES, "self_attn_out", a)
        x = x + gate * nn.Dropout(rate=self.dropout_rate)(a, deterministic=deterministic)
        self.sow(PROBES, "self_attn_residual", x)

        if not self.no_feedforward:
            ffn_gate = _gate(self, "ffn_gate", self.dtype)
            f = FeedForward(self.d_model, self.d_ff, self.num_layers, self.dtype, self.activation)(
                ZCRMSNorm(dtype=self.dtype)(x), ffn_mask=ffn_mask
            )
            self.sow(PROBES, "ffn_out", f)
            x = x + ffn_gate * nn.Dropout(rate=self.dropout_rate)(f, deterministic=deterministic)
        self.sow(PROBES, "out", x)
        return x


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention (+ optional FFN), each pre-normed and gated."""

    num_heads: int
    num_kv_heads: int
    d_model: int
    d_ff: int
    num_layers: int
    dtype: jnp.dtype = jnp.bfloat16
    activation: str = "drelu"
    dropout_rate: float = 0.0
    no_feedforward: bool = True
    decode: bool = False
    cache_len: int = 0
    use_cross_cache: bool = True

    @nn.compact
    def __call__(self, x, encoder_out, self_mask=None, cross_mask=None, rope=None, ffn_mask=None,
                 deterministic=True, cache_pos=None, cross_prefill=True):
        heads = (self.num_heads, self.num_kv_heads, self.d_model, self.num_layers, self.dtype)
        dropout = lambda y: nn.Dropout(rate=self.dropout_rate)(y, deterministic=deterministic)  # noqa: E731

        self_gate = _gate(self, "self_attn_gate", self.dtype)
        y = ZCRMSNorm(dtype=self.dtype)(x)
        a = MultiHeadAttention(*heads, decode=self.decode, cache_len=self.cache_len, name="self_attn")(
            y, y, mask=self_mask, rope=rope, cache_pos=cache_pos
        )
        self.sow(PROBES, "self_attn_out", a)
        x = x + self_gate * dropout(a)

        cross_gate = _gate(self, "cross_attn_gate", self.dtype)
        c = MultiHeadAttention(*heads, cross_cache=self.decode and self.use_cross_cache, name="cross_attn")(
            ZCRMSNorm(dtype=self.dtype)(x), encoder_out, mask=cross_mask, cross_prefill=cross_prefill
        )
        self.sow(PROBES, "cross_attn_out", c)
        x = x + cross_gate * dropout(c)

        if not self.no_feedforward:
            ffn_gate = _gate(self, "ffn_gate", self.dtype)
            f = FeedForward(self.d_model, self.d_ff, self.num_layers, self.dtype, self.activation)(
                ZCRMSNorm(dtype=self.dtype)(x), ffn_mask=ffn_mask
            )
            self.sow(PROBES, "ffn_out", f)
            x = x + ffn_gate * dropout(f)
        self.sow(PROBES, "out", x)
        return x


class _EncoderScanBody(nn.Module):
    """EncoderBlock as an nn.scan body: carry = (x, mask, rope, ffn_mask)."""

    block_args: tuple
    deterministic: bool = True

    @nn.compact
    def __call__(self, carry, _):
        x, mask, rope, ffn_mask = carry
        x = EncoderBlock(*self.block_args)(x, mask, rope, ffn_mask, self.deterministic)
        return (x, mask, rope, ffn_mask), None


class _DecoderScanBody(nn.Module):
    """DecoderBlock as an nn.scan body: carry = (x, enc, self_mask, cross_mask, rope, ffn_mask, cache_pos)."""

    block_args: tuple
    deterministic: bool = True
    cross_prefill: bool = True

    @nn.compact
    def __call__(self, carry, _):
        x, encoder_out, self_mask, cross_mask, rope, ffn_mask, cache_pos = carry
        x = DecoderBlock(*self.block_args)(
            x, encoder_out, self_mask, cross_mask, rope, ffn_mask, self.deterministic, cache_pos, self.cross_prefill
        )
        return (x, encoder_out, self_mask, cross_mask, rope, ffn_mask, cache_pos), None


def _scan_layers(body, length: int, extra_axes=()):
    """Stack a block over layers: params (and probes, caches) get a leading L axis."""
    axes = {"params": 0, PROBES: 0, **{name: 0 for name in extra_axes}}
    return nn.scan(
        nn.remat(body), variable_axes=axes, split_rngs={"params": True, "dropout": True}, length=length
    )


class Encoder(nn.Module):
    """Self-attention encoder; returns (out, mask)."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, mask=None, rope=None, ffn_mask=None, deterministic=True):
        cfg, dt = self.config, compute_dtype(self.config)
        x = x.astype(dt)
        self.sow(PROBES, "embed", x)
        block_args = (cfg.num_heads, cfg.num_kv_heads, cfg.d_model, cfg.d_ff, cfg.total_layers, dt,
                      cfg.activation, cfg.dropout_rate, cfg.no_feedforward)
        layers = _scan_layers(_EncoderScanBody, cfg.num_encoder_layers)(block_args, deterministic, name="layers")
        (x, _, _, _), _ = layers((x, mask, rope, ffn_mask), None)
        x = ZCRMSNorm(dtype=dt, name="final_norm")(x)
        self.sow(PROBES, "out", x)
        return x, mask


class Decoder(nn.Module):
    config: TransformerConfig

    @nn.compact
    def __call__(self, x, encoder_out, self_mask=None, cross_mask=None, rope=None, ffn_mask=None,
                 deterministic=True, decode=False, cache_pos=None, cache_len=0, cross_prefill=True,
                 use_cross_cache=True):
        cfg, dt = self.config, compute_dtype(self.config)
        x = x.astype(dt)
        self.sow(PROBES, "embed", x)
        if cache_pos is None:
            cache_pos = jnp.array(0, jnp.int32)
        block_args = (cfg.num_heads, cfg.num_kv_heads, cfg.d_model, cfg.d_ff, cfg.total_layers, dt,
                      cfg.activation, cfg.dropout_rate, cfg.no_feedforward, decode, cache_len, use_cross_cache)
        layers = _scan_layers(_DecoderScanBody, cfg.num_decoder_layers, ("cache",) if decode else ())
        (x, *_), _ = layers(block_args, deterministic, cross_prefill, name="layers")(
            (x, encoder_out, self_mask, cross_mask, rope, ffn_mask, cache_pos), None
        )
        x = ZCRMSNorm(dtype=dt)(x)  # decoder/ZCRMSNorm_0: the final norm
        self.sow(PROBES, "out", x)
        return x


# ----------------------------------------------------------------------------- model


class SimpleAttentionNetwork(nn.Module):
    """Encoder-decoder with shared embeddings, tied output, RoPE and gated residuals."""

    config: TransformerConfig

    def setup(self):
        cfg, dt = self.config, compute_dtype(self.config)
        self.embedding = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=jinit.normal(stddev=0.02))
        self.embed_scale = math.sqrt(cfg.d_model)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.contrastive_hidden = nn.Dense(cfg.d_model // 4, dtype=dt, kernel_init=default_init())
        self.contrastive_proj = nn.Dense(cfg.contrastive_dim, dtype=dt, use_bias=False, kernel_init=default_init())
        self.log_temp = self.param("log_temp", jinit.zeros, ())

    def _rope(self, seq_len: int):
        return precompute_rope_freqs(self.config.head_dim, seq_len, self.config.rope_theta)

    def _embed(self, tokens):
        # The weakly typed python scale is rounded to the embedding dtype first (JAX semantics).
        return self.embedding(tokens) * self.embed_scale  # (B, T, D)

    def _logits(self, x):
        logits = x.astype(jnp.float32) @ self.embedding.embedding.T  # (B, T, V) float32, tied
        self.sow(PROBES, "logits", logits)
        return logits

    def encode_text(self, src, src_mask=None, ffn_mask=None, deterministic=True):
        return self.encoder(self._embed(src), mask=src_mask, rope=self._rope(src.shape[1]), ffn_mask=ffn_mask,
                            deterministic=deterministic)

    def encode(self, src, src_mask=None, deterministic=True):
        """Returns (encoder_out (B, S, D), src_mask)."""
        return self.encode_text(src, src_mask=src_mask, deterministic=deterministic)

    def _run_decoder(self, encoder_out, tgt, tgt_mask=None, cross_mask=None, ffn_mask=None, deterministic=True):
        x = self.decoder(self._embed(tgt), encoder_out, self_mask=tgt_mask, cross_mask=cross_mask,
                         rope=self._rope(tgt.shape[1]), ffn_mask=ffn_mask, deterministic=deterministic)
        return x.astype(jnp.float32)

    def decode(self, tgt, encoder_out, self_mask=None, cross_mask=None, deterministic=True):
        """float32 logits (B, T, V)."""
        return self._logits(self._run_decoder(encoder_out, tgt, self_mask, cross_mask, deterministic=deterministic))

    def decode_step(self, tokens, encoder_out, self_mask, cross_mask, rope, cache_pos, cache_len,
                    cross_prefill=True, use_cross_cache=True):
        """Cached decoding of tokens (B, T) at positions cache_pos..cache_pos+T-1: float32 logits (B, T, V), never
        dropout (the torch twin's decode_step has the same contract). Needs mutable=["cache"].

        self_mask: (B|1, 1, T, cache_len) over cached positions; rope: tables for these positions only;
        cross_prefill: project and store the cross K/V (first step) or reuse them (later steps).
        """
        x = self.decoder(self._embed(tokens), encoder_out, self_mask=self_mask, cross_mask=cross_mask, rope=rope,
                         deterministic=True, decode=True, cache_pos=cache_pos, cache_len=cache_len,
                         cross_prefill=cross_prefill, use_cross_cache=use_cross_cache)
        return self._logits(x)

    def _mean_pool(self, encoder_out, enc_mask):
        """Mean over non-pad positions, count clamped to >= 1: (B, D)."""
        if enc_mask is None:
            keep = jnp.ones(encoder_out.shape[:2], dtype=encoder_out.dtype)  # (B, S)
        else:
            keep = enc_mask[:, 0, 0, :]  # (B, S)
        summed = jnp.sum(encoder_out * keep[:, :, None].astype(encoder_out.dtype), axis=1)  # (B, D)
        return summed / jnp.maximum(jnp.sum(keep, axis=1, keepdims=True), 1.0)

    def encode_contrastive(self, tokens, deterministic=True):
        """L2-normalised contrastive embedding (B, C)."""
        src_mask = make_padding_mask(tokens, self.config.pad_token_id)
        encoder_out, enc_mask = self.encode_text(tokens, src_mask=src_mask, deterministic=deterministic)
        projected = self.contrastive_proj(nn.relu(self.contrastive_hidden(self._mean_pool(encoder_out, enc_mask))))
        # sqrt(sum^2 + eps) keeps a smooth gradient at the origin.
        denom = jnp.sqrt(jnp.sum(projected.astype(jnp.float32) ** 2, axis=-1, keepdims=True) + 1e-12)
        out = projected / denom.astype(projected.dtype)
        self.sow(PROBES, "contrastive", out)
        return out

    def forward_contrastive(self, query_tokens, tool_tokens, deterministic=True):
        """(query embedding, tool embedding, log_temp)."""
        q_emb = self.encode_contrastive(query_tokens, deterministic=deterministic)
        t_emb = self.encode_contrastive(tool_tokens, deterministic=deterministic)
        return q_emb, t_emb, self.log_temp

    def __call__(self, src, tgt, src_mask=None, tgt_mask=None, cross_mask=None, deterministic=True):
        encoder_out, enc_mask = self.encode_text(src, src_mask=src_mask, deterministic=deterministic)
        return self.decode(tgt, encoder_out, self_mask=tgt_mask,
                           cross_mask=enc_mask if cross_mask is None else cross_mask, deterministic=deterministic)

    def init_all(self, src, tgt):
        """Touch every parameter (text path and contrastive head): use with init(..., method="init_all")."""
        src_mask = make_padding_mask(src, self.config.pad_token_id)
        tgt_mask = make_attention_mask(tgt, self.config.pad_token_id)
        encoder_out, enc_mask = self.encode_text(src, src_mask=src_mask)
        self._run_decoder(encoder_out, tgt, tgt_mask=tgt_mask, cross_mask=enc_mask)
        self.encode_contrastive(src)
        return jnp.zeros(())
