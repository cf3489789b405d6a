"""Needle 2 in PyTorch: the twin of needle_flax/v2/model.py, piece for piece and name for name.

Upstream's 45M decoder-only model (NEEDLE_V2.md §3): n residual lanes mixed by learned
routing (mHC), blocks of gated attention and a Hadamard MLP, a hashed n-gram memory at a
few layers, a tied output, an MTP head and two probe-pooled heads.

It computes in the dtype of its parameters (`model.to(torch.bfloat16)` gives upstream's
bf16 inference) and keeps upstream's float32 islands (§3.1): norm statistics, RoPE, the
whole lane routing and mixing, the engram gate and its injection sum, the attention
softmax, probe pooling, the tied logits, the contrastive norm and the confidence output.
Where upstream's JAX type promotion decides a dtype, the matching line says so, because
torch promotes 0-d tensors and Python scalars differently (§10.13).

Shapes: B batch, T length, D d_model, A attn_dim, H heads, K kv heads, g = H/K query heads per kv head,
h head dim (A/H), L layers, n mHC lanes, G engram sites, N engram tables, P Hadamard width (power of two >= D),
V vocab, c contrastive dim, C pooled cells (T·(L+1)), p probes.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convert.errors import ConfigError
from convert.v2.config import TransformerConfig
from convert.v2.mapping import CONFIDENCE_PROBES, CONTRASTIVE_PROBES, GROUPS
from needle_torch.layers import Tap, ZCRMSNorm, apply_rope, make_attention_mask, make_causal_mask, precompute_rope_freqs
from needle_torch.pretrained import Pretrained
from needle_torch.v2.engram import Engram, engram_indices, engram_masks
from needle_torch.v2.generate import DecodeCache, engram_history_masks, make_decode_mask
from needle_torch.v2.generate import generate as generate_cached
from needle_torch.v2.lanes import (
    aq,
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

F32_MIN = torch.finfo(torch.float32).min
FLASH_NEG = -0.7 * torch.finfo(torch.float32).max  # what jax.nn.dot_product_attention writes at masked logits


# ----------------------------------------------------------------------------- masks and small pure functions


def make_window_mask(seq_len: int, window: int, sink: Tensor | None = None, device=None) -> Tensor:
    """The window of §4 (hidden_cells): key j visible from query i iff i - j < window, or j is a sink.

    (1, 1, T, T), or (B, 1, T, T) with sink (B, T) (nonzero = sink). Not causal by itself: callers AND it with
    causal ∧ padding. window <= 0 means no window (all True)."""
    if sink is not None:
        device = sink.device
    if window <= 0:
        return torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=device)
    i = torch.arange(seq_len, device=device)
    near = ((i[:, None] - i[None, :]) < window)[None, None]  # (1, 1, T, T)
    if sink is not None:
        near = near | (sink != 0)[:, None, None, :]  # (B, 1, T, T)
    return near


def write_kv(cache: tuple[Tensor, Tensor, int | Tensor], k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Store k, v (B, K, S, h) at positions pos..pos+S-1 of one layer's buffers (k_buf, v_buf, pos), each
    (B, K, M, h); returns the keys and values to attend over.

    An int pos returns the filled prefix (B, K, pos+S, h). A 0-d tensor pos returns the whole buffer, so shapes
    never change (one compiled graph for every step); the mask then hides the later positions, which softmax
    gives exactly zero weight."""
    k_buf, v_buf, pos = cache
    S = k.shape[2]
    if isinstance(pos, Tensor):
        at = pos + torch.arange(S, device=k.device)  # (S,)
        k_buf.index_copy_(2, at, k.to(k_buf.dtype))
        v_buf.index_copy_(2, at, v.to(v_buf.dtype))
        return k_buf, v_buf
    k_buf[:, :, pos:pos + S] = k
    v_buf[:, :, pos:pos + S] = v
    return k_buf[:, :, :pos + S], v_buf[:, :, :pos + S]


def sigmoid(x: Tensor) -> Tensor:
    """jax.nn.sigmoid as XLA:CPU (the fixtures' backend) computes it: in float32 torch.sigmoid's value (within an
    ulp); in bf16/f16, XLA expands it to 1 / (1 + exp(-x)) and rounds after every op, which differs from
    torch.sigmoid's single rounding in ~35 % of bf16 elements, so the expansion is written out here."""
    return torch.sigmoid(x) if x.dtype == torch.float32 else 1 / (1 + torch.exp(-x))


def silu(x: Tensor) -> Tensor:
    """jax.nn.silu: x · sigmoid(x), the product rounded on its own (F.silu rounds once: a different bf16 value)."""
    return x * sigmoid(x)


def dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, flash: bool = True,
                          causal: bool = False) -> Tensor:
    """Upstream's attention of q (B, H, T, h) over k, v (B, K, S, h); mask bool (B|1, 1, T, S), True = attend.

    Query head j reads kv head j // g (consecutive GQA). Masked logits take a large finite negative (never -inf), so
    a fully masked row is a uniform average, never NaN. float32: one function for upstream's two paths, through SDPA
    with an additive finfo.min mask (equal to where(mask, s, min) exactly). Other dtypes: each path as upstream
    computes it (they differ in bf16) -> flash: f32 logits of the dtype's q, k, f32 softmax, probabilities cast to
    v's dtype, p·v in that dtype; non-flash: q·kᵀ rounded to the dtype, then f32, f32 softmax, p·v in float32.
    causal: the mask is known to hide every key after its query, the T queries being the last T of the S keys (a
    cached prefill); the value is the mask's either way, so this form reads the mask alone."""
    B, H, T, h = q.shape
    K, S = k.shape[1], k.shape[2]
    if q.dtype == torch.float32:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, F32_MIN)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1 / math.sqrt(h),
                                              enable_gqa=H != K)  # (B, H, T, h)
    g = H // K
    qg = q.reshape(B, K, g * T, h)  # (B, K, g·T, h): query heads k·g .. k·g + g-1 read kv head k
    m = mask[:, :, None]  # (B|1, 1, 1, T, S)
    if flash:
        s = (qg.float() @ k.float().transpose(-1, -2)).view(B, K, g, T, S) * (1 / math.sqrt(h))  # (B, K, g, T, S)
        p = s.masked_fill(~m, FLASH_NEG).softmax(dim=-1).to(v.dtype).view(B, K, g * T, S)  # (B, K, g·T, S)
        return (p @ v).view(B, H, T, h)  # (B, H, T, h) in v's dtype
    s = (qg @ k.transpose(-1, -2)).float().view(B, K, g, T, S) / math.sqrt(h)  # (B, K, g, T, S)
    p = s.masked_fill(~m, F32_MIN).softmax(dim=-1).view(B, K, g * T, S)  # (B, K, g·T, S) float32
    return (p @ v.float()).view(B, H, T, h)  # (B, H, T, h) float32


# ----------------------------------------------------------------------------- attention and MLP


class Attention(nn.Module):
    """`self_attn`: q/k ZCRMSNorm per head, RoPE after the norms, GQA, a sigmoid output gate."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D, A, h, K = config.d_model, config.attn_dim, config.head_dim, config.num_kv_heads
        self.num_heads, self.num_kv_heads, self.head_dim, self.flash = config.num_heads, K, h, config.flash
        self.q_proj = nn.Linear(D, A, bias=False)
        self.k_proj = nn.Linear(D, K * h, bias=False)
        self.v_proj = nn.Linear(D, K * h, bias=False)
        self.q_norm = ZCRMSNorm(h)
        self.k_norm = ZCRMSNorm(h)
        self.gate_proj = nn.Linear(D, A, bias=False)
        self.out_proj = nn.Linear(A, D, bias=False)

    def forward(self, x: Tensor, mask: Tensor, rope: tuple[Tensor, Tensor], quant: bool | Tensor = False,
                cache: tuple[Tensor, Tensor, int | Tensor] | None = None) -> Tensor:
        """cache: this layer's (k_buf, v_buf, pos) for cached decoding (write_kv); mask then covers its keys."""
        B, T, _ = x.shape
        H, K, h = self.num_heads, self.num_kv_heads, self.head_dim
        x = aq(x, quant)
        q, k, v, gate = self.q_proj(x), self.k_proj(x), self.v_proj(x), self.gate_proj(x)
        q = q.reshape(B, T, H, h).transpose(1, 2)  # (B, H, T, h)
        k = k.reshape(B, T, K, h).transpose(1, 2)  # (B, K, T, h)
        v = v.reshape(B, T, K, h).transpose(1, 2)  # (B, K, T, h)
        q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, *rope).to(q.dtype)  # RoPE in float32 (the f32 tables promote), cast back like upstream
        k = apply_rope(k, *rope).to(k.dtype)
        if cache is not None:  # K after k_norm and RoPE, V as projected: what the next steps attend over
            k, v = write_kv(cache, k, v)  # (B, K, M or pos + T, h)
        # a cache at an int position: the queries are the last T of the keys, and the decode mask is causal
        causal = cache is not None and not isinstance(cache[2], Tensor)
        out = dot_product_attention(q, k, v, mask, self.flash, causal)  # (B, H, T, h)
        out = out.transpose(1, 2).reshape(B, T, H * h)  # (B, T, A)
        out = aq(out * sigmoid(gate), quant)  # f32 out (bf16 non-flash) promotes, as upstream
        return self.out_proj(out.to(self.out_proj.weight.dtype))


def walsh_matrix(size: int, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """The normalised Sylvester-Walsh matrix H_P (natural order): H_1 = [1], H_2m = [[H, H], [H, -H]], / √P.

    Symmetric and orthonormal; the entries are ±f32(1/√P), then cast to `dtype` like upstream's."""
    if size < 1 or size & (size - 1):
        raise ConfigError(f"walsh_matrix needs a power of two, got {size}; pad the width to 1 << (P-1).bit_length()")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)  # (2m, 2m)
    return (h * torch.tensor(1 / math.sqrt(size), dtype=torch.float32)).to(dtype)


_WALSH: dict[str, Tensor] = {}  # fixed and read-only: built once per (P, dtype, device)


def _cached(key: str, build) -> Tensor:
    """_WALSH[key], built by build() on first use. A dict, not functools.lru_cache: torch.compile traces through an
    lru_cache (rebuilding the matrix inside every compiled step) but reads a tensor it finds in a dict as a graph
    input. A compiled region cannot build one (the new tensor would escape it), so new_cache builds it first."""
    if key not in _WALSH:
        with torch.inference_mode(False):  # built under inference_mode it could never be saved for a backward pass
            _WALSH[key] = build()
    return _WALSH[key]


def _cached_walsh(size: int, dtype: torch.dtype, device) -> Tensor:
    """walsh_matrix, built once per (P, dtype, device)."""
    return _cached(f"{size}/{dtype}/{torch.device(device)}", lambda: walsh_matrix(size, dtype, device))


def walsh_transform(x: Tensor) -> Tensor:
    """x · cast_dtype(H_P) over the last axis: upstream's dense product in x's dtype (float32 accumulation)."""
    return x @ _cached_walsh(x.shape[-1], x.dtype, x.device)


class HadamardMLP(nn.Module):
    """`hadamard_mlp`: pad to P, z = (d1 ⊙ x)·H, z = silu(d2 ⊙ z)·H, out = (d3 ⊙ z)[:D]; no bias, gate or norm."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        P = config.hada_dim
        self.d_model = config.d_model
        self.d1 = nn.Parameter(torch.ones(P))
        self.d2 = nn.Parameter(torch.ones(P))
        self.d3 = nn.Parameter(torch.full((P,), 0.02))

    def forward(self, x: Tensor) -> Tensor:
        x = F.pad(x, (0, self.d1.shape[0] - self.d_model))  # (B, T, P), zeros past D
        z = walsh_transform(self.d1 * x)
        z = walsh_transform(silu(self.d2 * z))
        return (self.d3 * z)[..., :self.d_model]  # (B, T, D)


# ----------------------------------------------------------------------------- block, lane layer, stack


class Block(nn.Module):
    """One layer's block (`block`, also `mtp_block`): engram injection, gated sandwich-normed attention, MLP."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D = config.d_model
        self.sqrt_d = math.sqrt(D)
        self.pre_attn_norm = ZCRMSNorm(D)  # Flax: ZCRMSNorm_0
        self.self_attn = Attention(config)
        self.post_attn_norm = ZCRMSNorm(D)
        self.attn_gate = nn.Parameter(torch.zeros(()))
        self.pre_hada_norm = ZCRMSNorm(D)
        self.hadamard_mlp = HadamardMLP(config)
        self.tap_engram_gate = Tap()
        self.tap_engram_inject = Tap()
        self.tap_attn_out = Tap()

    def forward(self, x: Tensor, mask: Tensor, rope: tuple[Tensor, Tensor], quant: bool | Tensor = False,
                engram: tuple[Tensor, Tensor, tuple[int, ...]] | None = None,
                cache: tuple[Tensor, Tensor, int | Tensor] | None = None) -> Tensor:
        """engram: (rms_unit(ek) (G, B, T, D) float32, ev (G, B, T, D), the sites g this layer injects);
        cache: the attention's K/V buffers and position for cached decoding."""
        B, T, D = x.shape
        if engram is None:  # mtp_block: no engram
            alpha, inject, sites = x.new_zeros((0, B, T), dtype=torch.float32), x.new_zeros((B, T, D)), ()
        else:
            ek_unit, ev, sites = engram
            # α[g] = σ(⟨rms_unit(x), rms_unit(ek[g])⟩ / √D) for every site, in float32 (√D: d_model, not h).
            alpha = torch.sigmoid(torch.einsum("btd,gbtd->gbt", rms_unit(x), ek_unit) / self.sqrt_d)  # (G, B, T)
            # Σ_g flags[l, g]·α[g]·f32(ev[g]): the sites whose flag is 0 add exact zeros, so they are left out.
            inject = x.new_zeros((B, T, D), dtype=torch.float32)
            for g in sites:
                inject = inject + alpha[g, ..., None] * ev[g].float()
            inject = inject.to(x.dtype)
        alpha = self.tap_engram_gate(alpha)
        inject = self.tap_engram_inject(inject)
        if sites:
            x = x + inject
        a = self.tap_attn_out(self.self_attn(self.pre_attn_norm(x), mask, rope, quant, cache))
        x = x + sigmoid(self.attn_gate).to(x.dtype) * self.post_attn_norm(a)
        return x + self.hadamard_mlp(self.pre_hada_norm(x))


class MHCLayer(nn.Module):
    """One scanned layer (upstream's `_ScanBody`): route the n lanes into the block and mix its output back."""

    def __init__(self, config: TransformerConfig, layer: int):
        super().__init__()
        n, nD = config.mhc_lanes, config.mhc_lanes * config.d_model
        self.layer = layer
        self.block = Block(config)
        self.phi_pre = nn.Linear(nD, n, bias=False)
        self.phi_post = nn.Linear(nD, n, bias=False)
        self.phi_res = nn.Linear(nD, n * n, bias=False)
        self.b_pre = nn.Parameter(torch.zeros(n))
        self.b_post = nn.Parameter(torch.zeros(n))
        self.b_res = nn.Parameter(4 * torch.eye(n))
        self.a_pre = nn.Parameter(torch.full((), 0.01))
        self.a_post = nn.Parameter(torch.full((), 0.01))
        self.a_res = nn.Parameter(torch.full((), 0.01))
        self.tap_hpre, self.tap_hpost, self.tap_hres = Tap(), Tap(), Tap()
        self.tap_u, self.tap_y, self.tap_state = Tap(), Tap(), Tap()

    def forward(self, lanes: Tensor, mask: Tensor, rope: tuple[Tensor, Tensor], quant: bool | Tensor = False,
                engram: tuple[Tensor, Tensor, tuple[int, ...]] | None = None,
                cache: tuple[Tensor, Tensor, int | Tensor] | None = None,
                offsets: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """lanes (B, T, n, D) in the compute dtype -> the new lanes, cast back to it (§10.7).

        offsets: this layer's lane_offsets, precomputed (cached decoding passes them, so that no layer index is
        baked into a compiled region and one serves every layer)."""
        dtype = lanes.dtype
        pre_off, post_off = lane_offsets(self.layer, lanes.shape[2], lanes.device) if offsets is None else offsets
        xhat = flat_lanes(lanes)  # (B, T, n·D) float32
        r_pre, r_post, r_res = project(xhat, (self.phi_pre.weight, self.phi_post.weight, self.phi_res.weight))
        hpre = self.tap_hpre(pre_weights(r_pre, self.a_pre, self.b_pre, pre_off))
        hpost = self.tap_hpost(post_weights(r_post, self.a_post, self.b_post, post_off))
        hres = self.tap_hres(res_weights(r_res, self.a_res, self.b_res))
        u = self.tap_u(read_lanes(hpre, lanes, dtype))  # (B, T, D)
        y = self.tap_y(self.block(u, mask, rope, quant, engram, cache) - u)  # block's own residuals, then - u (§10.6)
        return self.tap_state(write_lanes(hres, lanes, hpost, y, dtype))  # (B, T, n, D)


@torch.compiler.nested_compile_region  # under torch.compile: traced once, reused for every layer
def decode_layer(layer: MHCLayer, lanes: Tensor, mask: Tensor, rope: tuple[Tensor, Tensor],
                 engram: tuple[Tensor, Tensor, tuple[int, ...]] | None, cache: tuple[Tensor, Tensor, int | Tensor],
                 offsets: tuple[Tensor, Tensor]) -> Tensor:
    """One lane layer of a cached-decoding step (no quant). Eagerly just the call; under torch.compile a region
    traced once and reused for every layer (two variants: with and without an engram site), so that a step compiles
    one layer, not L."""
    return layer(lanes, mask, rope, False, engram, cache, offsets)


class Stack(nn.Module):
    """`stack`: broadcast x0 to n lanes, L lane layers, mean over lanes, final_norm."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.lanes = config.mhc_lanes
        self.sites = tuple(config.engram_layers)
        self.layers = nn.ModuleList(MHCLayer(config, i) for i in range(config.num_layers))
        self.final_norm = ZCRMSNorm(config.d_model)

    def forward(self, x0: Tensor, mask: Tensor, rope: tuple[Tensor, Tensor], quant: bool | Tensor = False,
                ek: Tensor | None = None, ev: Tensor | None = None, collect_hidden: bool = False,
                kv: tuple[Tensor, Tensor, int | Tensor] | None = None) -> tuple[Tensor, list[Tensor]]:
        """x0 (B, T, D) -> (final-normed x (B, T, D), [lane mean after each layer] if collect_hidden).

        kv: cached decoding's (K buffers, V buffers, pos, lane offsets), one (B, K, M, h) buffer and one pair of
        offsets per layer; layer i runs through decode_layer."""
        dtype = self.final_norm.scale.dtype  # the compute dtype
        B, T, D = x0.shape
        lanes = x0.to(dtype)[:, :, None, :].expand(B, T, self.lanes, D)  # (B, T, n, D)
        ek_unit = None if ek is None else rms_unit(ek)  # (G, B, T, D) float32: the same at every layer
        hidden = []
        for i, layer in enumerate(self.layers):
            sites = tuple(g for g, site in enumerate(self.sites) if site == i)
            if kv is None:
                lanes = layer(lanes, mask, rope, quant, None if ek is None else (ek_unit, ev, sites))
            else:  # a layer without a site gets no engram (the same function: it adds nothing)
                engram = None if not sites else (ek_unit[sites[0]:sites[0] + 1], ev[sites[0]:sites[0] + 1], (0,))
                lanes = decode_layer(layer, lanes, mask, rope, engram, (kv[0][i], kv[1][i], kv[2]), kv[3][i])
            if collect_hidden:
                hidden.append(lanes.mean(dim=2))  # (B, T, D) in the compute dtype
        return self.final_norm(lanes.mean(dim=2)), hidden


# ----------------------------------------------------------------------------- heads


def probe_pool(cells: Tensor, probes: Tensor, keep: Tensor, dtype: torch.dtype) -> Tensor:
    """Attention pooling of all cells by p learned probes: (B, T, L+1, D) -> (B, p·D) in `dtype`.

    Scores f32(cells)·f32(probes)ᵀ/√D over the C = T·(L+1) cells (token-major); cells of tokens with keep <= 0
    score -inf, as upstream's (so an all-pad row gives NaN, like upstream's); softmax, then the weighted sum
    of the float32 cells."""
    B, T, L1, D = cells.shape
    c = cells.reshape(B, T * L1, D).float()  # (B, C, D)
    kept = keep.repeat_interleave(L1, dim=1) > 0  # (B, C)
    scores = torch.einsum("bcd,pd->bpc", c, probes.float()) / math.sqrt(D)  # (B, p, C)
    scores = scores.masked_fill(~kept[:, None, :], float("-inf"))
    pooled = torch.einsum("bpc,bcd->bpd", scores.softmax(dim=-1), c)  # (B, p, D)
    return pooled.reshape(B, -1).to(dtype)  # (B, p·D)


class ContrastiveHead(nn.Module):
    """4 probes pool every cell; a bias-free projection, L2-normalised; returns (p, log_temp) with log_temp raw."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D = config.d_model
        self.probes = nn.Parameter(torch.empty(CONTRASTIVE_PROBES, D))
        self.proj = nn.Linear(CONTRASTIVE_PROBES * D, config.contrastive_dim, bias=False)
        self.log_temp = nn.Parameter(torch.full((), math.log(0.07)))

    def forward(self, cells: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
        p = self.proj(probe_pool(cells, self.probes, keep, self.proj.weight.dtype))  # (B, c)
        # The norm in float32 with +1e-12 inside the root, cast to p's dtype before the division (upstream's).
        return p / torch.sqrt(p.float().pow(2).sum(-1, keepdim=True) + 1e-12).to(p.dtype), self.log_temp


class ConfidenceHead(nn.Module):
    """8 probes pool every cell; a Dense with bias to one logit, returned as float32 (B,)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D = config.d_model
        self.probes = nn.Parameter(torch.empty(CONFIDENCE_PROBES, D))
        self.proj = nn.Linear(CONFIDENCE_PROBES * D, 1)

    def forward(self, cells: Tensor, keep: Tensor) -> Tensor:
        return self.proj(probe_pool(cells, self.probes, keep, self.proj.weight.dtype))[:, 0].float()  # (B,)


# ----------------------------------------------------------------------------- model


class SimpleAttentionNetwork(Pretrained, nn.Module):
    """Needle 2: decoder-only, n mHC lanes, engram memory, tied output; optional MTP and probe heads (`groups`)."""

    family = "v2"

    def __init__(self, config: TransformerConfig, *, groups: tuple[str, ...] = GROUPS):
        super().__init__()
        unknown = sorted(set(groups) - set(GROUPS))
        if unknown:
            raise ConfigError(f"Needle 2 has no optional group(s) {unknown}; choose from {list(GROUPS)}")
        self.config = config
        self.groups = tuple(g for g in GROUPS if g in groups)
        D = config.d_model
        self.embedding = nn.Embedding(config.vocab_size, D)
        self.embed_scale = math.sqrt(D)
        self.stack = Stack(config)
        self.engrams = nn.ModuleList(Engram(config) for _ in range(config.num_sites))
        if "mtp" in self.groups:
            self.mtp_combine = nn.Linear(2 * D, D, bias=False)
            self.mtp_emb_norm = ZCRMSNorm(D)
            self.mtp_final_norm = ZCRMSNorm(D)
            self.mtp_block = Block(config)
        if "contrastive" in self.groups:
            self.contrastive_head = ContrastiveHead(config)
        if "confidence" in self.groups:
            self.confidence_head = ConfidenceHead(config)
        self.tap_embed, self.tap_final_hidden, self.tap_logits, self.tap_mtp_logits = Tap(), Tap(), Tap(), Tap()
        self.tap_contrastive, self.tap_confidence, self.tap_engram_k, self.tap_engram_v = Tap(), Tap(), Tap(), Tap()
        self.reset_parameters()

    @classmethod
    def for_groups(cls, config: TransformerConfig, groups: tuple[str, ...]):
        return cls(config, groups=groups)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Upstream's initialisers (§2): N(0, 0.02) for matrices and tables, N(0, 0.02/√(2L)) for out_proj and
        value_proj, zeros for norm scales, gates and biases, d1 = d2 = 1, d3 = 0.02, taps = [1, 0, 0, 0],
        b_res = 4·I, a_* = 0.01, log_temp = ln 0.07."""
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith(("out_proj.weight", "value_proj.weight")):
                p.normal_(0.0, residual_std, generator=generator)
            elif leaf in ("weight", "probes", "embedding"):  # Linear/Embedding weights, probes, engram tables
                p.normal_(0.0, 0.02, generator=generator)
            elif leaf in ("d1", "d2"):
                p.fill_(1.0)
            elif leaf == "d3":
                p.fill_(0.02)
            elif leaf == "taps":
                p.zero_()
                p[0] = 1.0
            elif leaf == "b_res":
                p.copy_(4 * torch.eye(p.shape[0]))
            elif leaf.startswith("a_"):
                p.fill_(0.01)
            elif leaf == "log_temp":
                p.fill_(math.log(0.07))
            else:  # norm scales, attn_gate, b_pre, b_post, the confidence bias
                p.zero_()

    # ------------------------------------------------------------------ pieces

    def _rope(self, seq_len: int) -> tuple[Tensor, Tensor]:
        """cos, sin (T, h/2) float32: inv = 1/θ^(f32(2i)/h) in float32, angle = f32(t)·inv (§3.3, §10.2)."""
        return precompute_rope_freqs(self.config.head_dim, seq_len, self.config.rope_theta, self.device)

    def _embed(self, tokens: Tensor) -> Tensor:
        # Upstream multiplies by a weakly typed Python float, i.e. √D rounded to the embedding dtype first.
        scale = torch.tensor(self.embed_scale, dtype=self.dtype, device=self.device)
        return self.embedding(tokens) * scale  # (B, T, D)

    def _logits(self, x: Tensor) -> Tensor:
        return x.float() @ self.embedding.weight.float().T  # (B, T, V) float32, tied (E promoted like upstream)

    def engram_kv(self, tokens: Tensor, mask: Tensor, quant: bool | Tensor = False) -> tuple[Tensor, Tensor]:
        """Every site's engram key and value for these tokens and this mask: each (G, B, T, D)."""
        B, T = tokens.shape
        if not len(self.engrams):
            empty = self.embedding.weight.new_zeros((0, B, T, self.config.d_model))
            return self.tap_engram_k(empty), self.tap_engram_v(empty)
        idx = engram_indices(tokens, self.config)
        ngram_ok, tap_ok = engram_masks(mask, self.config)
        kv = [engram(idx, ngram_ok, tap_ok, quant) for engram in self.engrams]
        ek = torch.stack([k for k, _ in kv])  # (G, B, T, D)
        ev = torch.stack([v for _, v in kv])  # (G, B, T, D)
        return self.tap_engram_k(ek), self.tap_engram_v(ev)

    def _trunk(self, tokens: Tensor, mask: Tensor, quant: bool | Tensor, collect_hidden: bool
               ) -> tuple[Tensor, Tensor, list[Tensor], tuple[Tensor, Tensor]]:
        """(x0, stack output, per-layer lane means, rope) for these tokens under this mask."""
        x0 = self.tap_embed(self._embed(tokens))  # (B, T, D): what the stack broadcasts to the lanes
        rope = self._rope(tokens.shape[1])
        ek, ev = self.engram_kv(tokens, mask, quant)
        x, hidden = self.stack(x0, mask, rope, quant, ek, ev, collect_hidden)
        return x0, x, hidden, rope

    def _cell_mask(self, tokens: Tensor, window: int, sink: Tensor | None) -> Tensor:
        """causal ∧ key-not-pad (∧ the window with sinks): what the cell-based methods attend with (§4)."""
        mask = make_attention_mask(tokens, self.config.pad_token_id)  # (B, 1, T, T)
        return mask & make_window_mask(tokens.shape[1], window, sink, tokens.device) if window > 0 else mask

    # ------------------------------------------------------------------ entry points

    def forward(self, tokens: Tensor, mask: Tensor | None = None, quant: bool | Tensor = False,
                return_mtp: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """float32 logits (B, T, V), plus the MTP head's with return_mtp; mask bool (B|1, 1, T, T), default causal
        (pad tokens count as tokens, as upstream's)."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1], tokens.device)
        _, x, _, rope = self._trunk(tokens, mask, quant, False)
        x = self.tap_final_hidden(x)
        logits = self.tap_logits(self._logits(aq(x, quant)))
        if not return_mtp:
            return logits
        if "mtp" not in self.groups:
            raise ConfigError("return_mtp=True needs the MTP head, which this model was built without; build it "
                              "with groups including 'mtp' (or load a checkpoint that has the mtp_* tensors)")
        nxt = F.pad(tokens[:, 1:], (0, 1))  # (B, T): the next token, id 0 after the last
        e2 = self.mtp_emb_norm(self._embed(nxt))
        m = self.mtp_combine(aq(torch.cat([x, e2], dim=-1), quant))  # (B, T, 2D) -> (B, T, D), x first
        m = self.mtp_final_norm(self.mtp_block(m, mask, rope, quant))
        return logits, self.tap_mtp_logits(self._logits(aq(m, quant)))

    # ------------------------------------------------------------------ cached decoding (upstream's decode.py)

    def new_cache(self, batch: int, max_len: int, valid: Tensor | None = None, sink: Tensor | None = None,
                  kv_window: int = 0) -> DecodeCache:
        """An empty DecodeCache for `batch` rows and max_len buffer positions.

        valid: (B, max_len) bool, upstream's `valid` (False on left pads; None: all True); sink: (B, max_len) bool
        or None (positions that stay visible under kv_window)."""
        cfg, W = self.config, self.config.engram_history
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)]
        v = [torch.zeros_like(t) for t in k]
        hist = torch.zeros(batch, W + max_len, dtype=torch.long, device=self.device)
        if valid is None:
            valid = torch.ones(batch, max_len, dtype=torch.bool, device=self.device)
        valid = F.pad(valid.to(self.device, torch.bool), (W, 0))  # (B, W + M): False before the start
        sink = None if sink is None else sink.to(self.device, torch.bool)
        weight = None if self.dtype == torch.float32 else self.embedding.weight.float()  # upcast once per request
        offsets = [lane_offsets(i, cfg.mhc_lanes, self.device) for i in range(cfg.num_layers)]
        _cached_walsh(cfg.hada_dim, self.dtype, self.device)  # before any compiled region reads it
        return DecodeCache(k, v, hist, valid, sink, int(kv_window), self._rope(max_len), offsets, weight)

    def decode_step(self, tokens: Tensor, cache: DecodeCache, pos: int | Tensor, last_only: bool = False) -> Tensor:
        """Feed tokens (B, S) at buffer positions pos..pos+S-1: float32 logits (B, S, V) (B, 1, V with last_only).

        Writes the tokens into the history and their K/V into the cache. pos 0 with the prompt is upstream's
        prefill; S = 1 a step. An int pos attends over the filled prefix; a 0-d int64 tensor keeps every shape
        fixed (the whole buffer, later positions masked), so one compiled graph serves every step. RoPE reads the
        absolute buffer position (left padding shifts it, as upstream's). Runs in the model's dtype, no quant."""
        S = tokens.shape[1]
        hist, hist_valid, rope, mask = self._step_inputs(tokens, cache, pos)
        ek, ev = self._decode_engram(hist, hist_valid, S)
        x, _ = self.stack(self._embed(tokens), mask, rope, False, ek, ev, kv=(cache.k, cache.v, pos, cache.offsets))
        return self._decode_logits(x[:, -1:] if last_only else x, cache.logits_weight)

    def _step_inputs(self, tokens: Tensor, cache: DecodeCache, pos: int | Tensor
                     ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor], Tensor]:
        """Write tokens (B, S) into the history at pos; (history window (B, W + S), its validity, rope (S, h/2) each,
        the attention mask (B, 1, S, M or pos + S))."""
        S = tokens.shape[1]
        W = self.config.engram_history
        cos, sin = cache.rope
        if isinstance(pos, Tensor):
            positions = pos + torch.arange(S, device=tokens.device)  # (S,)
            cache.hist.index_copy_(1, W + positions, tokens)
            span = pos + torch.arange(W + S, device=tokens.device)  # (W + S,): history columns pos - W .. pos + S - 1
            hist, hist_valid = cache.hist.index_select(1, span), cache.valid.index_select(1, span)  # (B, W + S)
            rope = cos[positions], sin[positions]  # (S, h/2) each
            key_valid, sink = cache.valid[:, W:], cache.sink  # (B, M)
        else:
            positions = torch.arange(pos, pos + S, device=tokens.device)  # (S,)
            cache.hist[:, W + pos:W + pos + S] = tokens
            hist, hist_valid = cache.hist[:, pos:pos + W + S], cache.valid[:, pos:pos + W + S]  # (B, W + S)
            rope = cos[pos:pos + S], sin[pos:pos + S]  # (S, h/2) each
            key_valid = cache.valid[:, W:W + pos + S]  # (B, pos + S): the filled prefix
            sink = None if cache.sink is None else cache.sink[:, :pos + S]
        return hist, hist_valid, rope, make_decode_mask(positions, key_valid, cache.window, sink)

    def _decode_engram(self, hist: Tensor, hist_valid: Tensor, last: int) -> tuple[Tensor | None, Tensor | None]:
        """Every site's key and value (G, B, last, D) for the last `last` tokens of the history window (B, W + S),
        with validity from the history alone (upstream's decode: no attention mask, no kv_window)."""
        if not len(self.engrams):
            return None, None
        idx = engram_indices(hist, self.config)  # (B, W + S, N): zeros before the buffer start are hashed
        ngram_ok, tap_ok = engram_history_masks(hist_valid, self.config)
        kv = [engram(idx, ngram_ok, tap_ok, last=last) for engram in self.engrams]
        return torch.stack([k for k, _ in kv]), torch.stack([v for _, v in kv])  # (G, B, last, D) each

    def _decode_logits(self, x: Tensor, weight: Tensor | None) -> Tensor:
        """f32(x)·f32(E)ᵀ (B, S, V) against `weight`, E upcast once per request (None: E itself, a float32 model's)."""
        return x.float() @ (self.embedding.weight if weight is None else weight).float().T

    def generate(self, tokens: Tensor, max_new_tokens: int = 64, *, kv_window: int = 0, temperature: float = 0.0,
                 seed: int | None = None, sink: Tensor | None = None, eos_token_id: int | None = 1,
                 pad_token_id: int = 0, return_logits: bool = False, return_logprobs: bool = False,
                 streamer=None, compile: bool | str = False, fast: bool = True):
        """Cached generation from left-padded prompts (B, P): the new tokens (B, max_new_tokens), plus the step
        logits and log-probabilities on request; see needle_torch.v2.generate.generate."""
        return generate_cached(self, tokens, max_new_tokens, kv_window=kv_window, temperature=temperature, seed=seed,
                               sink=sink, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                               return_logits=return_logits, return_logprobs=return_logprobs, streamer=streamer,
                               compile=compile, fast=fast)

    # ------------------------------------------------------------------ hidden states and heads

    def hidden_states(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """float32 (L, B, T, D): the lane mean after each layer (no x0, no final norm); default causal, no quant."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1], tokens.device)
        _, _, hidden, _ = self._trunk(tokens, mask, False, True)
        return torch.stack(hidden).float()

    def hidden_cells(self, tokens: Tensor, quant: bool | Tensor = False, window: int = 0,
                     sink: Tensor | None = None) -> Tensor:
        """(B, T, L+1, D): [x0, lane mean after layer 0..L-1] under causal ∧ padding (∧ window/sinks)."""
        x0, _, hidden, _ = self._trunk(tokens, self._cell_mask(tokens, window, sink), quant, True)
        return torch.stack([x0, *hidden], dim=2)  # (B, T, L+1, D)

    def _keep(self, tokens: Tensor) -> Tensor:
        return tokens != self.config.pad_token_id  # (B, T)

    def _head(self, name: str) -> nn.Module:
        if name not in self.groups:
            raise ConfigError(f"this model was built without the {name} head; build it with groups including "
                              f"{name!r} (or load a checkpoint that has the {name}_head tensors)")
        return getattr(self, f"{name}_head")

    def encode_contrastive(self, tokens: Tensor, quant: bool | Tensor = False, window: int = 0,
                           sink: Tensor | None = None) -> Tensor:
        """The L2-normalised contrastive embedding (B, c); no gradient flows into the cells (upstream's)."""
        head = self._head("contrastive")
        cells = self.hidden_cells(tokens, quant, window, sink).detach()
        return self.tap_contrastive(head(cells, self._keep(tokens))[0])

    def forward_contrastive(self, query_tokens: Tensor, tool_tokens: Tensor, quant: bool | Tensor = False
                            ) -> tuple[Tensor, Tensor, Tensor]:
        """(query embedding, tool embedding, log_temp), log_temp raw (not exponentiated)."""
        return (self.encode_contrastive(query_tokens, quant), self.encode_contrastive(tool_tokens, quant),
                self._head("contrastive").log_temp)

    def forward_confidence(self, tokens: Tensor, quant: bool | Tensor = False, window: int = 0,
                           sink: Tensor | None = None) -> Tensor:
        """The confidence logit (B,) float32; no gradient flows into the cells."""
        head = self._head("confidence")
        cells = self.hidden_cells(tokens, quant, window, sink).detach()
        return self.tap_confidence(head(cells, self._keep(tokens)))


__all__ = [
    "Attention", "Block", "ConfidenceHead", "ContrastiveHead", "HadamardMLP", "MHCLayer", "SimpleAttentionNetwork",
    "Stack", "TransformerConfig", "dot_product_attention", "make_window_mask", "probe_pool", "walsh_matrix",
    "walsh_transform", "write_kv",
]
