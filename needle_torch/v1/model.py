"""Needle v1 in PyTorch: the twin of needle_flax/v1/model.py, piece for piece and name for name.

It computes in the dtype of its parameters (`model.to(torch.bfloat16)` gives upstream's
bf16 inference) and keeps upstream's float32 islands: norm statistics, RoPE output,
attention scores/softmax/PV, and logits. Where upstream's JAX type promotion decides a
dtype, the matching line here says so explicitly, because torch promotes 0-dim tensors
and python scalars differently.

Shapes: B batch, S source length, T target length, D d_model, H heads, K kv heads, G = H/K query heads per kv
head, h head dim, F d_ff, V vocab, L layers, C contrastive dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convert.v1.config import TransformerConfig
from needle_torch.layers import (
    Tap,
    ZCRMSNorm,
    apply_rope,
    make_causal_mask,
    make_padding_mask,
    precompute_rope_freqs,
)
from needle_torch.pretrained import Pretrained
from needle_torch.v1.generate import generate as generate_cached


def dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q k^T / sqrt(h)) v with upstream's precision; returns float32 (B, H, T, h).

    q (B, H, T, h); k, v (B, K, S, h); mask bool (B|1, 1, T|1, S), True = attend.
    Upstream's scores are float32 whatever the compute dtype (an f32 scale promotes them),
    but q k^T itself runs in the promoted dtype of q and k: float32 once RoPE has touched
    both, the compute dtype otherwise (cross-attention). Masked scores become
    finfo(float32).min, so a fully masked row is uniform, never NaN.
    """
    B, H, T, h = q.shape
    K, S = k.shape[1], k.shape[2]
    qk_dtype = torch.promote_types(q.dtype, k.dtype)
    if qk_dtype == torch.float32:
        # SDPA shares K/V across the G query heads (GQA) without materialising the repeats. An additive
        # finfo.min mask equals where(mask, s, min) exactly: |s| is far below min's spacing.
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=torch.float32, device=q.device)
            bias.masked_fill_(~mask, torch.finfo(torch.float32).min)
        return F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=bias, scale=1.0 / math.sqrt(h),
            enable_gqa=q.shape[1] != k.shape[1],
        )
    # The G query heads of a KV head become rows of one product against that head's keys: GQA
    # without broadcasting k and v over G (a broadcast matmul copies them G times).
    q = q.reshape(B, K, H // K * T, h)  # (B, K, G*T, h): head K*g+j reads kv head K
    scores = q.to(qk_dtype) @ k.to(qk_dtype).transpose(-1, -2)  # (B, K, G*T, S)
    scores = scores.float().view(B, K, H // K, T, S) / math.sqrt(h)  # (B, K, G, T, S)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], torch.finfo(torch.float32).min)
    probs = scores.softmax(dim=-1).view(B, K, H // K * T, S)  # (B, K, G*T, S)
    out = probs @ v.float()  # (B, K, G*T, h)
    return out.reshape(B, H, T, h)


# ----------------------------------------------------------------------------- attention


class MultiHeadAttention(nn.Module):
    def __init__(self, config: TransformerConfig, rope_keys_only: bool = False):
        super().__init__()
        D, h, K = config.d_model, config.head_dim, config.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, K, h
        self.rope_keys_only = rope_keys_only
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, K * h, bias=False)
        self.v_proj = nn.Linear(D, K * h, bias=False)
        self.out_proj = nn.Linear(D, D, bias=False)
        self.q_norm = ZCRMSNorm(h)
        self.k_norm = ZCRMSNorm(h)

    def project_kv(self, kv_input: Tensor) -> tuple[Tensor, Tensor]:
        """Normed keys and values, each (B, K, S, h), before RoPE."""
        B, S, _ = kv_input.shape
        k = self.k_proj(kv_input).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, S, h)
        v = self.v_proj(kv_input).view(B, S, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, K, S, h)
        return self.k_norm(k), v

    def forward(self, q_input: Tensor, kv_input: Tensor | None, mask: Tensor | None = None,
                rope: tuple[Tensor, Tensor] | None = None, cache: LayerCache | None = None,
                cache_pos: int | Tensor = 0, static_kv: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """cache: float32 self-attention K/V buffers written at cache_pos; static_kv: cross K/V projected once."""
        B, T, D = q_input.shape
        q = self.q_proj(q_input).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, h)
        q = self.q_norm(q)
        if rope is not None and not self.rope_keys_only:
            q = apply_rope(q, *rope)

        if static_kv is not None:
            k, v = static_kv
        else:
            k, v = self.project_kv(kv_input)
            if rope is not None:
                k = apply_rope(k, *rope)
            if cache is not None:
                # float32 like upstream's decode cache, so cached == uncached numerically.
                k, v = cache.write(k, v, cache_pos)  # (B, K, cache_pos + T, h)

        out = dot_product_attention(q, k, v, mask)  # (B, H, T, h) float32
        out = out.transpose(1, 2).reshape(B, T, D)  # (B, T, D)
        return self.out_proj(out.to(self.out_proj.weight.dtype))


@dataclass
class LayerCache:
    """One decoder layer's self-attention K/V, float32 (B, K, T_max, h)."""

    k: Tensor
    v: Tensor

    def write(self, k: Tensor, v: Tensor, pos: int | Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, K, T, h) at pos..pos+T; returns the keys/values to attend over.

        An int pos returns the filled prefix (B, K, pos+T, h). A 0-d tensor pos returns the whole
        buffer (B, K, T_max, h), so shapes never change (torch.compile, CUDA graphs); the caller
        then masks the positions after pos+T-1, which softmax gives exactly zero weight.
        """
        if isinstance(pos, Tensor):
            at = pos + torch.arange(k.shape[2], device=k.device)  # (T,)
            self.k.index_copy_(2, at, k.to(self.k.dtype))
            self.v.index_copy_(2, at, v.to(self.v.dtype))
            return self.k, self.v
        end = pos + k.shape[2]
        self.k[:, :, pos:end] = k
        self.v[:, :, pos:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


class FeedForward(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        D, Fd = config.d_model, config.d_ff
        self.activation = config.activation
        self.gate_proj = nn.Linear(D, Fd, bias=False)
        self.up_proj = nn.Linear(D, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, D, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)  # (B, T, F)
        if self.activation == "swiglu":
            hidden = F.silu(gate) * up
        elif self.activation == "geglu":
            hidden = F.gelu(gate, approximate="tanh") * up  # flax's default gelu is the tanh form
        else:  # drelu
            hidden = F.relu(gate) * F.relu(up)
        return self.down_proj(hidden)


# ----------------------------------------------------------------------------- blocks


def _gate(param: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.sigmoid(param).to(dtype)


def _dropout(dropout: nn.Dropout, deterministic: bool):
    """The block's dropout (active in train mode) when deterministic=False, else the identity.

    deterministic defaults to True in every method, as in the Flax twin (upstream's default): a torch user
    training with dropout passes deterministic=False (train mode alone applies none)."""
    return (lambda y: y) if deterministic else dropout


class EncoderBlock(nn.Module):
    """Pre-norm self-attention (+ optional FFN), each added through a sigmoid gate."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.attn_norm = ZCRMSNorm(config.d_model)  # Flax: ZCRMSNorm_0
        self.self_attn = MultiHeadAttention(config)
        self.attn_gate = nn.Parameter(torch.zeros(()))
        self.self_attn_residual = Tap()
        self.dropout = nn.Dropout(config.dropout_rate)
        self.has_ffn = not config.no_feedforward
        if self.has_ffn:
            self.ffn_norm = ZCRMSNorm(config.d_model)  # Flax: ZCRMSNorm_1
            self.ffn = FeedForward(config)  # Flax: FeedForward_0
            self.ffn_gate = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                deterministic: bool = True) -> Tensor:
        drop = _dropout(self.dropout, deterministic)
        y = self.attn_norm(x)
        x = x + _gate(self.attn_gate, x.dtype) * drop(self.self_attn(y, y, mask, rope))
        x = self.self_attn_residual(x)
        if self.has_ffn:
            x = x + _gate(self.ffn_gate, x.dtype) * drop(self.ffn(self.ffn_norm(x)))
        return x


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention (+ optional FFN), each pre-normed and gated."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D = config.d_model
        self.self_attn_norm = ZCRMSNorm(D)  # Flax: ZCRMSNorm_0
        self.self_attn = MultiHeadAttention(config)
        self.self_attn_gate = nn.Parameter(torch.zeros(()))
        self.cross_attn_norm = ZCRMSNorm(D)  # Flax: ZCRMSNorm_1
        self.cross_attn = MultiHeadAttention(config)
        self.cross_attn_gate = nn.Parameter(torch.zeros(()))
        self.dropout = nn.Dropout(config.dropout_rate)
        self.has_ffn = not config.no_feedforward
        if self.has_ffn:
            self.ffn_norm = ZCRMSNorm(D)  # Flax: ZCRMSNorm_2
            self.ffn = FeedForward(config)  # Flax: FeedForward_0
            self.ffn_gate = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor, encoder_out: Tensor | None, self_mask: Tensor | None = None,
                cross_mask: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                cache: LayerCache | None = None, cache_pos: int | Tensor = 0,
                cross_kv: tuple[Tensor, Tensor] | None = None, deterministic: bool = True) -> Tensor:
        drop = _dropout(self.dropout, deterministic)
        y = self.self_attn_norm(x)
        a = self.self_attn(y, y, self_mask, rope, cache=cache, cache_pos=cache_pos)
        x = x + _gate(self.self_attn_gate, x.dtype) * drop(a)
        c = self.cross_attn(self.cross_attn_norm(x), encoder_out, cross_mask, static_kv=cross_kv)
        x = x + _gate(self.cross_attn_gate, x.dtype) * drop(c)
        if self.has_ffn:
            x = x + _gate(self.ffn_gate, x.dtype) * drop(self.ffn(self.ffn_norm(x)))
        return x


class Encoder(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.embed = Tap()
        self.layers = nn.ModuleList(EncoderBlock(config) for _ in range(config.num_encoder_layers))
        self.final_norm = ZCRMSNorm(config.d_model)

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                deterministic: bool = True) -> Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, mask, rope, deterministic)
        return self.final_norm(x)


@dataclass
class DecoderCache:
    """Per-layer state for cached decoding: self-attention K/V buffers and cross K/V (+ RoPE tables for T_max)."""

    layers: list[LayerCache]
    cross_kv: list[tuple[Tensor, Tensor]]
    rope: tuple[Tensor, Tensor] | None = None  # cos, sin (T_max, h/2): computed once, not at every step
    logits_weight: Tensor | None = None  # the tied embedding in float32 (V, D): upcast once, not at every step


class Decoder(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.embed = Tap()
        self.layers = nn.ModuleList(DecoderBlock(config) for _ in range(config.num_decoder_layers))
        self.final_norm = ZCRMSNorm(config.d_model)  # Flax: decoder/ZCRMSNorm_0

    def forward(self, x: Tensor, encoder_out: Tensor | None, self_mask: Tensor | None = None,
                cross_mask: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                cache: DecoderCache | None = None, cache_pos: int | Tensor = 0, deterministic: bool = True) -> Tensor:
        x = self.embed(x)
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, encoder_out, self_mask, cross_mask, rope, deterministic=deterministic)
            else:
                x = layer(x, None, self_mask, cross_mask, rope, cache.layers[i], cache_pos, cache.cross_kv[i],
                          deterministic)
        return self.final_norm(x)


# ----------------------------------------------------------------------------- model


class SimpleAttentionNetwork(Pretrained, nn.Module):
    """Encoder-decoder with shared embeddings, tied output, RoPE and gated residuals."""

    family = "v1"

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        D = config.d_model
        self.embedding = nn.Embedding(config.vocab_size, D)
        self.embed_scale = math.sqrt(D)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.contrastive_hidden = nn.Linear(D, D // 4)
        self.contrastive_proj = nn.Linear(D // 4, config.contrastive_dim, bias=False)
        self.log_temp = nn.Parameter(torch.zeros(()))
        self.logits_tap = Tap()
        self.contrastive_tap = Tap()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Upstream's initialisers: N(0, 0.02), out/down projections N(0, 0.02/sqrt(2L)), zeros elsewhere."""
        residual_std = 0.02 / math.sqrt(2 * self.config.total_layers)
        for name, p in self.named_parameters():
            if name.endswith(("out_proj.weight", "down_proj.weight")):
                p.normal_(0.0, residual_std, generator=generator)
            elif name.endswith("weight"):
                p.normal_(0.0, 0.02, generator=generator)
            else:  # norm scales, gates, biases, log_temp
                p.zero_()

    def _rope(self, seq_len: int, offset: int = 0) -> tuple[Tensor, Tensor]:
        cos, sin = precompute_rope_freqs(self.config.head_dim, offset + seq_len, self.config.rope_theta, self.device)
        return cos[offset:], sin[offset:]

    def _embed(self, tokens: Tensor) -> Tensor:
        # Upstream multiplies by a weakly typed scalar, i.e. rounded to the embedding dtype first.
        scale = torch.tensor(self.embed_scale, dtype=self.dtype, device=self.device)
        return self.embedding(tokens) * scale  # (B, T, D)

    def _logits(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """float32 logits against the tied embedding; weight: that embedding already in float32 (V, D)."""
        weight = self.embedding.weight.float() if weight is None else weight
        return self.logits_tap(x.float() @ weight.T)  # (B, T, V) float32, tied

    def encode(self, src: Tensor, src_mask: Tensor | None = None, *, deterministic: bool = True,
               ) -> tuple[Tensor, Tensor | None]:
        """Returns (encoder_out (B, S, D), src_mask); deterministic=False applies dropout in train mode."""
        return self.encoder(self._embed(src), src_mask, self._rope(src.shape[1]), deterministic), src_mask

    def decode(self, tgt: Tensor, encoder_out: Tensor, self_mask: Tensor | None = None,
               cross_mask: Tensor | None = None, *, deterministic: bool = True) -> Tensor:
        """float32 logits (B, T, V); deterministic=False applies dropout in train mode."""
        x = self.decoder(self._embed(tgt), encoder_out, self_mask, cross_mask, self._rope(tgt.shape[1]),
                         deterministic=deterministic)
        return self._logits(x)

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                cross_mask: Tensor | None = None, deterministic: bool = True) -> Tensor:
        encoder_out, enc_mask = self.encode(src, src_mask, deterministic=deterministic)
        return self.decode(tgt, encoder_out, tgt_mask, enc_mask if cross_mask is None else cross_mask,
                           deterministic=deterministic)

    # ------------------------------------------------------------------ cached decoding

    def new_cache(self, encoder_out: Tensor, max_len: int) -> DecoderCache:
        """Empty float32 self-attention buffers for max_len positions and cross K/V projected once."""
        B, cfg = encoder_out.shape[0], self.config
        shape = (B, cfg.num_kv_heads, max_len, cfg.head_dim)
        layers = [
            LayerCache(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
            for _ in self.decoder.layers
        ]
        # Stored contiguous, or every step's attention would copy them again. V is only ever read upcast to
        # float32 (p @ v runs in float32), so keeping it upcast is exact; K stays in the compute dtype (q k^T).
        cross = [(k.contiguous(), v.float().contiguous())
                 for k, v in (layer.cross_attn.project_kv(encoder_out) for layer in self.decoder.layers)]
        return DecoderCache(layers, cross, self._rope(max_len), self.embedding.weight.float())

    def decode_step(self, tokens: Tensor, cache: DecoderCache, cache_pos: int | Tensor,
                    self_mask: Tensor | None = None, cross_mask: Tensor | None = None) -> Tensor:
        """Decode tokens (B, T) at positions cache_pos.. with the cache; float32 logits (B, T, V).

        cache_pos: an int attends over the filled prefix; a 0-d int64 tensor keeps every shape fixed
        (attends over the whole buffer, later positions masked) so a compiled step never recompiles.
        self_mask: (B|1, 1, T, cache_pos + T), or (B|1, 1, T, T_max) for a tensor cache_pos, over cached
        positions; None means causal. Never applies dropout, in either mode (as Flax's decode_step): it is inference.
        """
        T = tokens.shape[1]
        if isinstance(cache_pos, Tensor):
            positions = cache_pos + torch.arange(T, device=self.device)  # (T,)
            cos, sin = cache.rope if cache.rope is not None else self._rope(cache.layers[0].k.shape[2])
            rope = cos[positions], sin[positions]  # (T, h/2) each
            if self_mask is None:
                keys = torch.arange(cache.layers[0].k.shape[2], device=self.device)  # (T_max,)
                self_mask = (keys <= positions[:, None])[None, None]  # (1, 1, T, T_max)
        else:
            if cache.rope is not None and cache_pos + T <= cache.rope[0].shape[0]:
                rope = cache.rope[0][cache_pos:], cache.rope[1][cache_pos:]
            else:
                rope = self._rope(T, offset=cache_pos)
            if self_mask is None and T > 1:
                self_mask = make_causal_mask(cache_pos + T, self.device)[:, :, cache_pos:]
        x = self.decoder(self._embed(tokens), None, self_mask, cross_mask, rope, cache, cache_pos, deterministic=True)
        return self._logits(x, cache.logits_weight)

    # ------------------------------------------------------------------ contrastive

    def _mean_pool(self, encoder_out: Tensor, enc_mask: Tensor | None) -> Tensor:
        """Mean over non-pad positions, count clamped to >= 1: (B, D)."""
        if enc_mask is None:
            keep = torch.ones(encoder_out.shape[:2], dtype=torch.bool, device=encoder_out.device)  # (B, S)
        else:
            keep = enc_mask[:, 0, 0, :]  # (B, S)
        summed = (encoder_out * keep[:, :, None].to(encoder_out.dtype)).sum(dim=1)  # (B, D)
        counts = keep.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
        # Upstream divides by a float32 count and rounds once to the compute dtype.
        return (summed.float() / counts.float()).to(encoder_out.dtype)

    def encode_contrastive(self, tokens: Tensor) -> Tensor:
        """L2-normalised contrastive embedding (B, C)."""
        encoder_out, enc_mask = self.encode(tokens, make_padding_mask(tokens, self.config.pad_token_id))
        projected = self.contrastive_proj(F.relu(self.contrastive_hidden(self._mean_pool(encoder_out, enc_mask))))
        # sqrt(sum^2 + eps) keeps a smooth gradient at the origin.
        denom = torch.sqrt(projected.float().pow(2).sum(-1, keepdim=True) + 1e-12)
        return self.contrastive_tap(projected / denom.to(projected.dtype))

    def forward_contrastive(self, query_tokens: Tensor, tool_tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(query embedding, tool embedding, log_temp)."""
        return self.encode_contrastive(query_tokens), self.encode_contrastive(tool_tokens), self.log_temp

    # ------------------------------------------------------------------ generation

    def generate(self, src: Tensor, src_mask: Tensor | None = None, max_new_tokens: int = 64, eos_token_id: int = 1,
                 suppress_tokens=None, pad_token_id: int = 0, **kwargs) -> Tensor:
        """Greedy cached decoding from EOS: LongTensor (B, 1 + steps); see needle_torch.v1.generate.generate."""
        return generate_cached(self, src, src_mask, max_new_tokens, eos_token_id, suppress_tokens, pad_token_id,
                               **kwargs)
