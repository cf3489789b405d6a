"""Needle 3 in PyTorch: the twin of needle_flax/v3/model.py, piece for piece and name for name.

Upstream's laddered decoder (cactus-needle 3.x, NEEDLE_V3.md §3): n residual lanes mixed by learned routing
(mHC), blocks of conv-tapped gated attention (sliding window except on global layers) and a Monarch Hadamard
MLP, a hashed n-gram memory at a few layers, a tied output, nested depth rungs (exit_depth), and three heads on
one per-layer probe pool. Upstream's code is the definition; this file is the same computation as a plain
nn.Module with a Python loop over the layers where upstream scans.

Dtypes (§3.1): config.dtype is the compute dtype dt; parameters stay in their own dtype and are cast to dt
exactly where upstream casts them (Dense layers, taps, Monarch factors and vectors, cond_v/u, gates), so a
float32 model with a bf16 config computes like upstream's bf16 inference on float32 params. float32 islands:
norm statistics, RoPE, the lane routing and mixing, the engram gate, the attention softmax, probe pooling and
the tied logits. Where JAX rounds an intermediate to dt, the matching line here rounds it too.

Shapes: B batch, T length, D d_model, H heads, K kv heads, hq qk head dim, hv v head dim, F = max(hq, hv),
τ conv taps, L layers, n mHC lanes, G engram sites, N engram tables, s sub dim, P Hadamard width (power of two
>= D), (a, b) Monarch factor sizes (a·b = P), V vocab, k probes, Q queries, L1 = L+1 cell rows, c embedding dim.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convert.errors import ConfigError
from convert.v3.config import ENGRAM_TAPS, HADA_COND_RANK, TransformerConfig, hada_perms, walsh_matrix
from convert.v3.ladder import ladder_layer_ranks
from convert.v3.mapping import GROUPS, HEADS
from needle_torch.layers import (
    TORCH_DTYPES,
    Tap,
    ZCRMSNorm,
    apply_rope,
    make_causal_mask,
    make_padding_mask,
    precompute_rope_freqs,
    repeat_kv,
)
from needle_torch.pretrained import Pretrained
from needle_torch.v2.lanes import fake_quant_act, rms_unit, sinkhorn
from needle_torch.v3.engram import engram_indices, shift_right
from needle_torch.v3.generate import generate as generate_cached
from needle_torch.v3.quant import head_weight, quant_kv, quant_query

F32_MIN = torch.finfo(torch.float32).min  # the non-flash path's masked logit
FLASH_NEG = -0.7 * torch.finfo(torch.float32).max  # what jax.nn.dot_product_attention writes at masked logits
DEFAULT_HEADS = tuple(HEADS)  # ("embedding_head", "confidence_head", "router_head")


# ----------------------------------------------------------------------------- masks and small pure functions


def make_window_mask(seq_len: int, window: int, device=None) -> Tensor:
    """(1, 1, T, T) bool: key j is visible from query i iff i - j < window (not causal by itself)."""
    i = torch.arange(seq_len, device=device)
    return ((i[:, None] - i[None, :]) < window)[None, None]  # (1, 1, T, T)


def mask_diag(mask: Tensor, offset: int) -> Tensor:
    """d[b, t] = mask[b, 0, t, t - offset], False for t < offset: (B|1, 1, T, T) -> (B|1, T) (upstream's _mask_diag)."""
    m = mask[:, 0]  # (B|1, T, T)
    T = m.shape[-1]
    if offset >= T:
        return m.new_zeros(m.shape[:-2] + (T,))
    d = torch.diagonal(m, offset=-offset, dim1=-2, dim2=-1)  # (B|1, T - o)
    if offset == 0:
        return d
    return torch.cat([d.new_zeros(d.shape[:-1] + (offset,)), d], dim=-1)


def _sigmoid(x: Tensor) -> Tensor:
    """jax.nn.sigmoid as XLA:CPU (the goldens' backend) computes it: torch's in float32; in bf16/f16 1 / (1 + exp(-x))
    rounded after every op (torch.sigmoid rounds once: another bf16 value in about a third of the elements)."""
    return torch.sigmoid(x) if x.dtype == torch.float32 else 1 / (1 + torch.exp(-x))


def _softmax(x: Tensor) -> Tensor:
    """jax.nn.softmax over the last axis, rounding where it rounds: exp(x - max) in x's dtype, the sum in float32
    cast back to x's dtype, then the division (torch.softmax rounds a bf16 result once)."""
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / e.float().sum(dim=-1, keepdim=True).to(x.dtype)


def _aq(x: Tensor, quant: bool, bits: int) -> Tensor:
    """Upstream's _aq: per-row A`bits` fake-quant over the last axis under quant, else x."""
    return fake_quant_act(x, bits) if quant else x


class _Dense(nn.Linear):
    """Flax's nn.Dense(dtype=dt, use_bias=False): input and weight cast to the compute dtype, then x·Wᵀ."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__(in_features, out_features, bias=False)
        self.compute_dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(self.compute_dtype), self.weight.to(self.compute_dtype))


class Engram(nn.Module):
    """One engram site (`engrams_{g}`): N table rows gathered, projected to a key and a value, 4 dilated taps."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        N, S, s, D = config.num_engram_tables, config.engram_slots, config.engram_sub_dim, config.d_model
        self.compute_dtype = TORCH_DTYPES[config.dtype]
        self.dilation, self.act_bits = config.engram_dilation, config.act_bits
        self.embedding = nn.Parameter(torch.empty(N, S, s))
        self.key_proj = _Dense(N * s, D, self.compute_dtype)
        self.value_proj = _Dense(N * s, D, self.compute_dtype)
        self.taps = nn.Parameter(torch.empty(ENGRAM_TAPS, D))

    def forward(self, indices: Tensor, ngram_ok: Tensor, tap_ok: Tensor, quant: bool = False) -> tuple[Tensor, Tensor]:
        """indices (B, T, N), ngram_ok (B|1, T, N) bool, tap_ok (4, B|1, T) bool -> key, value (B, T, D) in dt."""
        dt = self.compute_dtype
        N = self.embedding.shape[0]
        fetched = self.embedding[torch.arange(N, device=indices.device), indices]  # (B, T, N, s), the table dtype
        fetched = fetched * ngram_ok[..., None]
        e = _aq(fetched.reshape(*indices.shape[:2], -1).to(dt), quant, self.act_bits)  # (B, T, N·s)
        k, v = self.key_proj(e), self.value_proj(e)  # (B, T, D)
        taps = self.taps.to(dt)
        v = sum(taps[j] * shift_right(v, j * self.dilation) * tap_ok[j][..., None] for j in range(ENGRAM_TAPS))
        return k, v


def conv_taps(z: Tensor, taps: Tensor, tap_ok: list[Tensor | None]) -> Tensor:
    """The causal depthwise conv on projected channels: z[t] <- Σ_j taps[j] ⊙ (z[t - j]·ok_j[t]).

    z (B, T, C), taps (τ, C) in z's dtype; tap_ok[j] (B|1, T, 1) in z's dtype, or None (unmasked). Tap 0 is
    never masked, not even on pad rows: tap_ok[0] is not read."""
    out = 0
    for j in range(taps.shape[0]):
        shifted = shift_right(z, j)
        if j and tap_ok[j] is not None:
            shifted = shifted * tap_ok[j]
        out = out + taps[j] * shifted
    return out


class MultiHeadAttention(nn.Module):
    """`self_attn`: conv taps on q/k/v, q/k ZCRMSNorm over hq, RoPE for hq, GQA, flash or not, a sigmoid gate."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D, H, K, tau = config.d_model, config.num_heads, config.num_kv_heads, config.qkv_conv_taps
        hq, hv = config.head_dims
        dt = TORCH_DTYPES[config.dtype]
        self.config, self.compute_dtype = config, dt
        self.num_heads, self.num_kv_heads, self.hq, self.hv, self.flash = H, K, hq, hv, config.flash
        self.q_proj = _Dense(D, H * hq, dt)
        self.k_proj = _Dense(D, K * hq, dt)
        self.v_proj = _Dense(D, K * hv, dt)
        if tau:
            self.q_taps = nn.Parameter(torch.empty(tau, H * hq))
            self.k_taps = nn.Parameter(torch.empty(tau, K * hq))
            self.v_taps = nn.Parameter(torch.empty(tau, K * hv))
            self.tap_q_conv, self.tap_k_conv, self.tap_v_conv = Tap(), Tap(), Tap()
        self.tap_q, self.tap_k, self.tap_v = Tap(), Tap(), Tap()
        self.q_norm = ZCRMSNorm(hq)
        self.k_norm = ZCRMSNorm(hq)
        self.gate_proj = _Dense(D, H * hv, dt)
        self.out_proj = _Dense(H * hv, D, dt)

    def forward(self, x: Tensor, mask: Tensor | None, rope: tuple[Tensor, Tensor] | None,
                quant: bool = False) -> Tensor:
        """x (B, T, D) in dt, mask bool (B|1, 1, T, T) (this layer's), rope (cos, sin) (T, hq/2) -> (B, T, D)."""
        B, T, _ = x.shape
        H, K, hq, hv, dt = self.num_heads, self.num_kv_heads, self.hq, self.hv, self.compute_dtype
        x = _aq(x, quant, self.config.act_bits)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # (B, T, H·hq), (B, T, K·hq), (B, T, K·hv)
        q, k, v = self.tap_q(q), self.tap_k(k), self.tap_v(v)
        if self.config.qkv_conv_taps:
            tap_ok = [None] + [None if mask is None else mask_diag(mask, j)[..., None].to(q.dtype)
                               for j in range(1, self.config.qkv_conv_taps)]  # (B|1, T, 1) each
            q = conv_taps(q, self.q_taps.to(dt), tap_ok)
            k = conv_taps(k, self.k_taps.to(dt), tap_ok)
            v = conv_taps(v, self.v_taps.to(dt), tap_ok)
            q, k, v = self.tap_q_conv(q), self.tap_k_conv(k), self.tap_v_conv(v)
        q = q.reshape(B, T, H, hq).transpose(1, 2)  # (B, H, T, hq)
        k = k.reshape(B, T, K, hq).transpose(1, 2)  # (B, K, T, hq)
        v = v.reshape(B, T, K, hv).transpose(1, 2)  # (B, K, T, hv)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # RoPE in float32 (the tables promote), rounded back to dt as upstream's astype
            q = apply_rope(q, *rope).to(q.dtype)
            k = apply_rope(k, *rope).to(k.dtype)
        q = quant_query(q, quant, self.config)
        k = quant_kv(k, quant, self.config)
        v = quant_kv(v, quant, self.config)
        k, v = repeat_kv(k, H // K), repeat_kv(v, H // K)  # (B, H, T, hq), (B, H, T, hv): consecutive GQA
        if self.flash:
            # jax.nn.dot_product_attention on q pre-scaled by √(F/hq) in dt (1.15625 for √(4/3) in bf16) and
            # zero-padded to F, with its own scale 1/√F: f32 logits, f32 softmax, probabilities cast to v's dtype.
            Fd = max(hq, hv)
            qf = q * torch.tensor(math.sqrt(Fd / hq), dtype=q.dtype)
            qf, kf, vf = F.pad(qf, (0, Fd - hq)), F.pad(k, (0, Fd - hq)), F.pad(v, (0, Fd - hv))  # (B, H, T, F)
            logits = qf.float() @ kf.float().transpose(-1, -2)  # (B, H, T, T)
            logits = logits * torch.tensor(1 / math.sqrt(Fd), dtype=torch.float32)
            if mask is not None:
                logits = logits.masked_fill(~mask, FLASH_NEG)
            out = logits.softmax(dim=-1).to(vf.dtype) @ vf  # (B, H, T, F)
            out = out[..., :hv].transpose(1, 2).reshape(B, T, H * hv)  # (B, T, H·hv)
        else:
            # q·kᵀ rounded to dt, then divided by the float32 √hq (which promotes); f32 softmax and p·v.
            logits = (q @ k.transpose(-1, -2)).float() / torch.sqrt(torch.tensor(hq, dtype=torch.float32))
            if mask is not None:
                logits = logits.masked_fill(~mask, F32_MIN)
            out = logits.softmax(dim=-1) @ v.float()  # (B, H, T, hv)
            out = out.transpose(1, 2).reshape(B, T, H * hv)  # (B, T, H·hv)
        out = out * _sigmoid(self.gate_proj(x))
        return self.out_proj(_aq(out, quant, self.config.act_bits))


def kron_apply(z: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """z (..., P) -> Aᵀ·Z·B on the row-major (a, b) view Z, flattened back: z·(A⊗B) for a row vector z.

    Two products, Aᵀ·Z first, each rounded to z's dtype: the order XLA contracts upstream's 3-operand einsum in."""
    lead = z.shape[:-1]
    z = z.reshape(*lead, a.shape[0], b.shape[0])  # (..., a, b)
    z = torch.einsum("...ij,ik->...kj", z, a)  # (..., a, b)
    z = torch.einsum("...kj,jl->...kl", z, b)  # (..., a, b)
    return z.reshape(*lead, a.shape[0] * b.shape[0])  # (..., P)


class HadamardMLP(nn.Module):
    """`hadamard_mlp`: three learned Kronecker pairs between two fixed permutations, low-rank conditioning."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D, P = config.d_model, config.hada_dim
        a, b = config.hada_blocks
        self.d_model, self.split = D, bool(config.ladder_widths)
        self.compute_dtype = dt = TORCH_DTYPES[config.dtype]
        for s in (1, 2, 3):
            setattr(self, f"w{s}a", nn.Parameter(torch.empty(a, a)))
            setattr(self, f"w{s}b", nn.Parameter(torch.empty(b, b)))
        self.d1, self.d2, self.b2 = (nn.Parameter(torch.empty(P)) for _ in range(3))
        self.d3, self.d4 = (nn.Parameter(torch.empty(P)) for _ in range(2))
        self.cond_v = _Dense(D, HADA_COND_RANK, dt)
        self.cond_u = _Dense(HADA_COND_RANK, P, dt)
        # upstream's two fixed gathers (numpy RandomState(11), (13)), made here and not in forward: an index made
        # under inference_mode must not reach an autograd forward, and a traced forward needs no numpy. On the CPU
        # even under a meta-device build (no state dict holds them); .to(x.device) in forward covers the rest.
        p1, p2 = hada_perms(P, self.split)
        self.register_buffer("p1", torch.as_tensor(p1, dtype=torch.long, device="cpu"), persistent=False)
        self.register_buffer("p2", torch.as_tensor(p2, dtype=torch.long, device="cpu"), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        """x (B, T, D) in dt, the pre-normed block input -> (B, T, D) in dt."""
        dt, P = self.compute_dtype, self.d1.shape[0]
        p1, p2 = self.p1.to(x.device), self.p2.to(x.device)  # (P,) each
        w = {name: getattr(self, name).to(dt) for name in ("w1a", "w1b", "w2a", "w2b", "w3a", "w3b")}
        d1, d2, b2, d3, d4 = (t.to(dt) for t in (self.d1, self.d2, self.b2, self.d3, self.d4))
        cond = 1 + self.cond_u(_softmax(self.cond_v(x)))  # (B, T, P), from the unpadded x
        z = F.pad(x, (0, P - self.d_model))  # (B, T, P)
        z = kron_apply(d1 * z, w["w1a"], w["w1b"])[..., p1]
        z = d2 * cond * z + b2
        z = kron_apply(z * _sigmoid(z), w["w2a"], w["w2b"])[..., p2]  # jax.nn.silu: x·σ(x), two roundings
        z = kron_apply(d3 * z, w["w3a"], w["w3b"])
        return (d4 * z)[..., :self.d_model]  # (B, T, D)


class Block(nn.Module):
    """`block`: engram injection, x + σ(attn_gate)·post_norm(attn(norm(x))), then x + MLP(pre_hada_norm(x))."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        D = config.d_model
        self.compute_dtype = TORCH_DTYPES[config.dtype]
        self.pre_attn_norm = ZCRMSNorm(D)  # Flax: ZCRMSNorm_0
        self.self_attn = MultiHeadAttention(config)
        self.post_attn_norm = ZCRMSNorm(D)
        self.attn_gate = nn.Parameter(torch.zeros(()))
        self.pre_hada_norm = ZCRMSNorm(D)
        self.hadamard_mlp = HadamardMLP(config)
        self.tap_attn_out, self.tap_mlp_out, self.tap_engram_gate = Tap(), Tap(), Tap()

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                quant: bool = False, engram_kv: tuple[Tensor, Tensor] | None = None,
                site_flags: Tensor | None = None) -> Tensor:
        """x (B, T, D) in dt; engram_kv every site's (key, value) (G, B, T, D); site_flags (G,) float32, 1 where
        this layer injects site g."""
        if engram_kv is not None:
            ek, ev = engram_kv
            # α[g] = σ(⟨rms_unit(x), rms_unit(ek[g])⟩/√D) for every site, in float32; the flags pick this layer's.
            alpha = self.tap_engram_gate(torch.sigmoid(torch.einsum("btd,sbtd->sbt", rms_unit(x), rms_unit(ek))
                                                       / math.sqrt(x.shape[-1])))  # (G, B, T)
            x = x + torch.einsum("s,sbt,sbtd->btd", site_flags, alpha, ev.float()).to(x.dtype)  # (B, T, D)
        skip = x
        x = self.tap_attn_out(self.self_attn(self.pre_attn_norm(x), mask, rope, quant))
        x = skip + _sigmoid(self.attn_gate).to(self.compute_dtype) * self.post_attn_norm(x)
        return x + self.tap_mlp_out(self.hadamard_mlp(self.pre_hada_norm(x)))


def _lane_offsets(lane: int, n: int, device=None) -> tuple[Tensor, Tensor]:
    """(pre_off, post_off) (n,) float32: +4 / 0 on lane `lane`, -4 on the others."""
    one_hot = (torch.arange(n, device=device) == lane).float()  # (n,)
    return 8 * one_hot - 4, -4 * (1 - one_hot)


class MHCLayer(nn.Module):
    """One layer of the lane stream (upstream's scan body): route the n lanes into the block, mix its output back.

    Holds the block and this layer's slice of upstream's stacked `stack/mhc_*` routing parameters."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        n, nD = config.mhc_lanes, config.mhc_lanes * config.d_model
        self.compute_dtype, self.act_bits = TORCH_DTYPES[config.dtype], config.act_bits
        self.block = Block(config)
        self.phi_pre = nn.Linear(nD, n, bias=False)
        self.phi_post = nn.Linear(nD, n, bias=False)
        self.phi_res = nn.Linear(nD, n * n, bias=False)
        self.b_pre = nn.Parameter(torch.empty(n))
        self.b_post = nn.Parameter(torch.empty(n))
        self.b_res = nn.Parameter(torch.empty(n, n))
        self.a_pre = nn.Parameter(torch.empty(()))
        self.a_post = nn.Parameter(torch.empty(()))
        self.a_res = nn.Parameter(torch.empty(()))
        self.tap_lanes_in, self.tap_hpre, self.tap_u, self.tap_hpost = Tap(), Tap(), Tap(), Tap()
        self.tap_hres, self.tap_lanes_out = Tap(), Tap()

    def forward(self, lanes: Tensor, offsets: tuple[Tensor, Tensor], mask: Tensor | None = None,
                rope: tuple[Tensor, Tensor] | None = None, quant: bool = False,
                engram_kv: tuple[Tensor, Tensor] | None = None, site_flags: Tensor | None = None) -> Tensor:
        """lanes (B, T, n, D) in dt -> the new lanes in dt; offsets (pre_off, post_off) of this stream's lane.

        The routing runs in float32 on float32 copies of φ (a bf16 a_* or b_* promotes to float32)."""
        B, T, n, D = lanes.shape
        pre_off, post_off = offsets
        lanes = self.tap_lanes_in(lanes)
        xf = lanes.float()
        nx = _aq(rms_unit(lanes.reshape(B, T, n * D)), quant, self.act_bits)  # (B, T, n·D) float32
        hpre = self.tap_hpre(torch.sigmoid(self.a_pre * F.linear(nx, self.phi_pre.weight.float()) + self.b_pre
                                           + pre_off))  # (B, T, n)
        u = self.tap_u(torch.einsum("btn,btnc->btc", hpre, xf).to(self.compute_dtype))  # (B, T, D)
        y = self.block(u, mask, rope, quant, engram_kv, site_flags) - u
        hpost = self.tap_hpost(2 * torch.sigmoid(self.a_post * F.linear(nx, self.phi_post.weight.float())
                                                 + self.b_post + post_off))
        res = F.linear(nx, self.phi_res.weight.float())  # (B, T, n·n)
        hres = self.tap_hres(sinkhorn(self.a_res * res.reshape(B, T, n, n) + self.b_res))  # (B, T, n, n)
        out = (torch.einsum("btij,btjc->btic", hres, xf)
               + hpost[..., None] * y.float()[:, :, None, :]).to(self.compute_dtype)  # (B, T, n, D)
        return self.tap_lanes_out(out)


class Stack(nn.Module):
    """`stack`: x0 broadcast to n lanes, L lane layers (window or global masks), lane mean, final_norm.

    With exit_depth d a second stream runs only the layers of ladder rank < d, with the lane offsets of its own
    positions (capture mode); subnetwork_only computes only that stream."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.compute_dtype = TORCH_DTYPES[config.dtype]
        self.layers = nn.ModuleList(MHCLayer(config) for _ in range(config.num_layers))
        self.final_norm = ZCRMSNorm(config.d_model)
        self.tap_final_hidden = Tap()

    def forward(self, x: Tensor, mask: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
                engram_kv: tuple[Tensor, Tensor] | None = None, collect_hidden: bool = False, quant: bool = False,
                exit_depth: int | None = None, subnetwork_only: bool = False):
        """x (B, T, D) -> (x (B, T, D) final-normed, hidden (L, B, T, D) in dt or None), and the exit stream's
        final-normed x last in capture mode. hidden is the lane mean after each layer, of the exit stream when
        there is one."""
        cfg, dt = self.config, self.compute_dtype
        if subnetwork_only and exit_depth is None:
            raise ConfigError("subnetwork_only requires exit_depth; pass the rung's depth, e.g. exit_depth=2")
        B, T, D = x.shape
        n, G = cfg.mhc_lanes, cfg.num_sites
        local_mask = None
        if cfg.sliding_window and mask is not None:
            local_mask = mask & make_window_mask(T, cfg.sliding_window, x.device)  # (B|1, 1, T, T)
        capture = exit_depth is not None and not subnetwork_only
        ranks = ladder_layer_ranks(cfg)
        active = [exit_depth is not None and r < exit_depth for r in ranks]
        sub_lane = [(sum(active[:i + 1]) - 1) % n for i in range(cfg.num_layers)]  # position among active layers
        full = sub = x.to(dt)[:, :, None, :].expand(B, T, n, D)  # (B, T, n, D)
        hidden = []
        for i, layer in enumerate(self.layers):
            layer_mask = mask if local_mask is None or i in cfg.global_layers else local_mask
            flags = torch.tensor([float(site == i) for site in cfg.engram_layers], device=x.device)  # (G,)
            run = functools.partial(layer, mask=layer_mask, rope=rope, quant=quant, engram_kv=engram_kv,
                                    site_flags=flags if G else None)
            if not subnetwork_only:
                full = run(full, _lane_offsets(i % n, n, x.device))
            if exit_depth is not None and active[i]:
                sub = run(sub, _lane_offsets(sub_lane[i], n, x.device))
            if collect_hidden:
                hidden.append((sub if exit_depth is not None else full).mean(dim=2))  # (B, T, D)
        hidden = torch.stack(hidden) if collect_hidden else None  # (L, B, T, D)
        if subnetwork_only:
            return self.final_norm(sub.mean(dim=2)), hidden
        if capture:
            both = self.final_norm(torch.cat([full.mean(dim=2), sub.mean(dim=2)], dim=0))  # (2B, T, D)
            x, sub_x = both.split(B, dim=0)
            return x, hidden, sub_x
        return self.tap_final_hidden(self.final_norm(full.mean(dim=2))), hidden


# ----------------------------------------------------------------------------- heads


def probe_pool(cells: Tensor, keep: Tensor | None, probes: Tensor, gain: Tensor, query: Tensor, bias: Tensor,
               row_keep: Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The two-stage per-layer probe pool, all float32: (B, T, L1, D) cells -> (B, Q·D) in `dtype`.

    Stage 1: each layer row's k probes attend over the tokens (keep <= 0 scores -inf: an all-pad row is NaN, as
    upstream's); rms_unit then gain. Stage 2: Q queries attend over the L1·k pooled vectors (l-major; rows with
    row_keep = 0 score -inf)."""
    cf = cells.float()
    B, T, L1, D = cf.shape
    k, Q = probes.shape[1], query.shape[0]
    scores = torch.einsum("btld,lkd->blkt", cf, probes.float()) / math.sqrt(D)  # (B, L1, k, T)
    if keep is not None:
        scores = scores.masked_fill(~(keep[:, None, None, :] > 0), float("-inf"))
    r = torch.einsum("blkt,btld->blkd", scores.softmax(dim=-1), cf)  # (B, L1, k, D)
    r = rms_unit(r) * gain.float()[None, :, :, None]
    u = torch.einsum("blkd,qd->bqlk", r, query.float()) / math.sqrt(D) + bias.float()[None]  # (B, Q, L1, k)
    if row_keep is not None:
        u = u.masked_fill(~(row_keep[None, None, :, None] > 0), float("-inf"))
    w = u.reshape(B, Q, L1 * k).softmax(dim=-1)  # (B, Q, L1·k)
    return torch.einsum("bqm,bmd->bqd", w, r.reshape(B, L1 * k, D)).reshape(B, Q * D).to(dtype)  # (B, Q·D)


class HeadProjection(nn.Linear):
    """A head's `proj`: y = dt(pooled)·dt(W)ᵀ (+ dt(bias)); under quant W is CQ-4 along its input axis."""

    def __init__(self, in_features: int, features: int, use_bias: bool, dtype: torch.dtype):
        super().__init__(in_features, features, bias=use_bias)
        self.compute_dtype = dtype

    def forward(self, x: Tensor, quant: bool = False) -> Tensor:
        dt = self.compute_dtype
        y = x.to(dt) @ head_weight(self.weight, quant).to(dt).T  # (B, out)
        return y if self.bias is None else y + self.bias.to(dt)  # added after the product, as upstream


class ProbeHead(nn.Module):
    """A probe head over the cells: per-row probes and gains, Q queries with row biases, then `proj`."""

    key = ""
    out_dim = 0

    def __init__(self, config: TransformerConfig, out_dim: int | None = None, use_bias: bool = True):
        super().__init__()
        name = self.key.removesuffix("_head")
        L1, D = config.num_layers + 1, config.d_model
        k, Q = getattr(config, f"{name}_probes"), getattr(config, f"{name}_queries")
        self.compute_dtype = TORCH_DTYPES[config.dtype]
        self.probes = nn.Parameter(torch.empty(L1, k, D))
        self.gain = nn.Parameter(torch.empty(L1, k))
        self.query = nn.Parameter(torch.empty(Q, D))
        self.row_bias = nn.Parameter(torch.empty(Q, L1, k))
        self.proj = HeadProjection(Q * D, out_dim or self.out_dim, use_bias, self.compute_dtype)
        self.tap_pooled = Tap()

    def pooled(self, cells: Tensor, keep: Tensor | None, row_keep: Tensor | None, quant: bool = False) -> Tensor:
        return self.tap_pooled(probe_pool(cells, keep, head_weight(self.probes, quant), self.gain,
                                          head_weight(self.query, quant), self.row_bias, row_keep,
                                          self.compute_dtype))  # (B, Q·D) in dt

    def forward(self, cells: Tensor, keep: Tensor | None = None, row_keep: Tensor | None = None,
                quant: bool = False) -> Tensor:
        return self.proj(self.pooled(cells, keep, row_keep, quant), quant).float()  # (B, out)


class EmbeddingHead(ProbeHead):
    """The sentence embedding: bias-free `proj` to c, L2-normalised in dt; log_temp and bias are training-only."""

    key = "embedding_head"

    def __init__(self, config: TransformerConfig):
        super().__init__(config, config.embedding_dim, use_bias=False)
        self.log_temp = nn.Parameter(torch.empty(()))
        self.bias = nn.Parameter(torch.empty(()))

    def forward(self, cells: Tensor, keep: Tensor | None = None, row_keep: Tensor | None = None,
                quant: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        p = self.proj(self.pooled(cells, keep, row_keep, quant), quant)  # (B, c) in dt
        denom = torch.sqrt(p.float().pow(2).sum(-1, keepdim=True) + 1e-12)  # float32, cast before dividing
        return p / denom.to(p.dtype), self.log_temp, self.bias


class ConfidenceHead(ProbeHead):
    """One confidence logit."""

    key, out_dim = "confidence_head", 1


class RouterHead(ProbeHead):
    """Three router logits; `calibration` (3,) only with the router_calibration group (the export reads it)."""

    key, out_dim = "router_head", 3
    calibration_init = (0.90, 0.00, 0.60)

    def __init__(self, config: TransformerConfig, calibration: bool = False):
        super().__init__(config)
        if calibration:
            self.calibration = nn.Parameter(torch.empty(3))


# ----------------------------------------------------------------------------- model


class SimpleAttentionNetwork(Pretrained, nn.Module):
    """Needle 3: decoder-only, n mHC lanes, engram memory, tied output, depth rungs; optional heads (`groups`)."""

    family = "v3"

    def __init__(self, config: TransformerConfig, *, groups: tuple[str, ...] = DEFAULT_HEADS):
        super().__init__()
        unknown = sorted(set(groups) - set(GROUPS))
        if unknown:
            raise ConfigError(f"Needle 3 has no optional group(s) {unknown}; choose from {list(GROUPS)}")
        if "router_calibration" in groups and "router_head" not in groups:
            raise ConfigError("the router_calibration group lives in the router head; add 'router_head' to groups")
        self.config = config
        self.groups = tuple(g for g in GROUPS if g in groups)
        self.embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_scale = math.sqrt(config.d_model)
        self.stack = Stack(config)
        self.engrams = nn.ModuleList(Engram(config) for _ in config.engram_layers)
        self.tap_embed, self.tap_engram_k, self.tap_engram_v = Tap(), Tap(), Tap()
        if "embedding_head" in self.groups:
            self.embedding_head = EmbeddingHead(config)
        if "confidence_head" in self.groups:
            self.confidence_head = ConfidenceHead(config)
        if "router_head" in self.groups:
            self.router_head = RouterHead(config, calibration="router_calibration" in self.groups)
        self.reset_parameters()

    @classmethod
    def for_groups(cls, config: TransformerConfig, groups: tuple[str, ...]):
        return cls(config, groups=groups)

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """Upstream's initialisers (§2): N(0, 0.02) for matrices, tables, probes and queries, N(0, 0.02/√(2L)) for
        out_proj and the engram value_proj; zeros for norm scales, gates, b2, cond_u, b_pre/b_post, row biases and
        head biases; identity taps (row 0 ones); Walsh factors; d1 = d2 = d3 = 1, d4 = 0.02; b_res = 4·I; a_* =
        0.01; gains 1; log_temp = ln 10, the embedding head's bias -10; the router calibration (0.9, 0, 0.6)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.num_layers)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith(("out_proj.weight", "value_proj.weight")):
                p.normal_(0.0, residual_std, generator=generator)
            elif name.endswith("cond_u.weight") or leaf in ("scale", "attn_gate", "b2", "b_pre", "b_post",
                                                            "row_bias") or name.endswith("proj.bias"):
                p.zero_()
            elif leaf in ("weight", "embedding", "probes", "query"):  # Dense/Embedding weights, phi, tables
                p.normal_(0.0, 0.02, generator=generator)
            elif leaf.endswith("taps"):
                p.zero_()
                p[0] = 1.0
            elif leaf[0] == "w" and leaf[-1] in "ab":  # w1a .. w3b: H_a ⊗ H_b = H_P
                p.copy_(torch.as_tensor(walsh_matrix(p.shape[0])))
            elif leaf in ("d1", "d2", "d3", "gain"):
                p.fill_(1.0)
            elif leaf == "d4":
                p.fill_(0.02)
            elif leaf == "b_res":
                p.copy_(4 * torch.eye(p.shape[0]))
            elif leaf.startswith("a_"):
                p.fill_(0.01)
            elif name == "embedding_head.log_temp":
                p.fill_(math.log(10.0))
            elif name == "embedding_head.bias":
                p.fill_(-10.0)
            elif leaf == "calibration":
                p.copy_(torch.tensor(RouterHead.calibration_init))
            else:
                raise AssertionError(f"reset_parameters has no initialiser for {name}")

    # ------------------------------------------------------------------ pieces

    def _rope(self, seq_len: int, device) -> tuple[Tensor, Tensor]:
        """cos, sin (T, hq/2) float32, built for the qk head dim."""
        return precompute_rope_freqs(self.config.head_dims[0], seq_len, self.config.rope_theta, device)

    def _engram_kv(self, tokens: Tensor, mask: Tensor, quant: bool) -> tuple[Tensor, Tensor] | None:
        """Every site's (key, value), each (G, B, T, D); validity from the full mask, never the window's."""
        if not len(self.engrams):
            return None
        cfg = self.config
        indices = engram_indices(tokens, cfg)  # (B, T, N)
        ngram_ok = torch.stack([mask_diag(mask, o - 1) for o in cfg.engram_orders
                                for _ in range(cfg.engram_heads_resolved)], dim=-1)  # (B|1, T, N)
        tap_ok = torch.stack([mask_diag(mask, j * cfg.engram_dilation) for j in range(ENGRAM_TAPS)])  # (4, B|1, T)
        pairs = [e(indices, ngram_ok, tap_ok, quant) for e in self.engrams]
        return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])  # (G, B, T, D) each

    def _input_embeddings(self, tokens: Tensor) -> Tensor:
        # Upstream multiplies by a weakly typed Python float: √D rounded to the table's dtype first.
        scale = torch.tensor(self.embed_scale, dtype=self.embedding.weight.dtype)
        return self.embedding(tokens) * scale  # (B, T, D), the table's dtype

    def _logits(self, x: Tensor, quant: bool) -> Tensor:
        """f32(aq(x))·f32(E_out)ᵀ (B, T, V_out): tied, the first out_vocab rows when out_vocab is set."""
        head = self.embedding.weight
        if self.config.out_vocab:
            head = head[:self.config.out_vocab]
        return _aq(x, quant, self.config.act_bits).float() @ head.float().T  # (B, T, V_out)

    # ------------------------------------------------------------------ entry points

    def forward(self, tokens: Tensor, mask: Tensor | None = None, quant: bool = False, exit_depth: int | None = None,
                exit_only: bool = False, subnetwork_only: bool = False):
        """float32 logits (B, T, V_out); with exit_depth (logits, exit_logits), exit_only the exit logits alone,
        subnetwork_only the depth-`exit_depth` subnetwork's logits. mask bool (B|1, 1, T, T), default causal (pad
        tokens count as tokens, as upstream's)."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1], tokens.device)
        x = self.tap_embed(self._input_embeddings(tokens))
        rope = self._rope(tokens.shape[1], tokens.device)
        engram_kv = self._engram_kv(tokens, mask, quant)
        if engram_kv is not None:
            engram_kv = (self.tap_engram_k(engram_kv[0]), self.tap_engram_v(engram_kv[1]))
        out = self.stack(x, mask, rope, engram_kv, quant=quant, exit_depth=exit_depth, subnetwork_only=subnetwork_only)
        if subnetwork_only or exit_depth is None:
            return self._logits(out[0], quant)
        exit_logits = self._logits(out[2], quant)
        if exit_only:
            return exit_logits
        return self._logits(out[0], quant), exit_logits

    def hidden_states(self, tokens: Tensor, mask: Tensor | None = None) -> Tensor:
        """float32 (L, B, T, D): the lane mean after each layer; default causal, no quant."""
        if mask is None:
            mask = make_causal_mask(tokens.shape[1], tokens.device)
        x = self._input_embeddings(tokens)
        rope = self._rope(tokens.shape[1], tokens.device)
        _, hidden = self.stack(x, mask, rope, self._engram_kv(tokens, mask, False), collect_hidden=True)
        return hidden.float()

    def hidden_cells(self, tokens: Tensor, quant: bool = False, window: int = 0, sink: Tensor | None = None,
                     exit_depth: int | None = None) -> Tensor:
        """(B, T, L1, D): [x0, lane mean after each layer] under causal ∧ key-not-pad (∧ i - j < window, or j a sink
        (B, T) nonzero); with exit_depth the rows are the exit stream's (an inactive layer repeats its row)."""
        T = tokens.shape[1]
        mask = make_causal_mask(T, tokens.device) & make_padding_mask(tokens, self.config.pad_token_id)
        if window:
            keep = make_window_mask(T, window, tokens.device)  # (1, 1, T, T)
            if sink is not None:
                keep = keep | (sink != 0)[:, None, None, :]  # (B, 1, T, T)
            mask = mask & keep
        x0 = self._input_embeddings(tokens)
        rope = self._rope(T, tokens.device)
        hidden = self.stack(x0, mask, rope, self._engram_kv(tokens, mask, quant), collect_hidden=True, quant=quant,
                            exit_depth=exit_depth)[1]
        dtype = torch.promote_types(x0.dtype, hidden.dtype)  # jnp.stack promotes a float32 x0 with bf16 rows
        return torch.stack([x0.to(dtype), *hidden.to(dtype)], dim=2)  # (B, T, L1, D)

    def _head_cells(self, tokens: Tensor, quant: bool, window: int, sink: Tensor | None, exit_depth: int | None):
        """(cells detached, keep (B, T) float32, row_keep (L1,) float32 or None): no gradient reaches the trunk."""
        cells = self.hidden_cells(tokens, quant, window, sink, exit_depth).detach()
        keep = (tokens != self.config.pad_token_id).float()  # (B, T)
        row_keep = None
        if exit_depth is not None:
            ranks = torch.tensor(ladder_layer_ranks(self.config), device=tokens.device)
            row_keep = torch.cat([torch.ones(1, device=tokens.device), (ranks < exit_depth).float()])  # (L1,)
        return cells, keep, row_keep

    def _head(self, name: str) -> ProbeHead:
        if name not in self.groups:
            raise ConfigError(f"this model was built without the {name}; build it with groups including {name!r} "
                              f"(or load a checkpoint that has the {name} tensors)")
        return getattr(self, name)

    def forward_embedding(self, tokens: Tensor, quant: bool = False, window: int = 0, sink: Tensor | None = None,
                          exit_depth: int | None = None) -> Tensor:
        """The L2-normalised sentence embedding (B, c) in dt."""
        head = self._head("embedding_head")
        return head(*self._head_cells(tokens, quant, window, sink, exit_depth), quant=quant)[0]

    def forward_confidence(self, tokens: Tensor, quant: bool = False, window: int = 0, sink: Tensor | None = None,
                           exit_depth: int | None = None) -> Tensor:
        """The confidence logit (B,) float32."""
        head = self._head("confidence_head")
        return head(*self._head_cells(tokens, quant, window, sink, exit_depth), quant=quant)[..., 0]

    def forward_router(self, tokens: Tensor, quant: bool = False, window: int = 0, sink: Tensor | None = None,
                       exit_depth: int | None = None) -> Tensor:
        """The router logits (B, 3) float32."""
        head = self._head("router_head")
        return head(*self._head_cells(tokens, quant, window, sink, exit_depth), quant=quant)

    def generate(self, tokens: Tensor, max_new_tokens: int = 64, **options):
        """Cached generation from left-padded prompts (B, P): the new tokens (B, max_new_tokens), greedy by default;
        options (layers, kv_window, sink, quant, temperature, seed, eos/pad ids, returns, streamer, compile):
        needle_torch.v3.generate."""
        return generate_cached(self, tokens, max_new_tokens, **options)


__all__ = [
    "Block", "ConfidenceHead", "EmbeddingHead", "Engram", "HadamardMLP", "HeadProjection", "MHCLayer",
    "MultiHeadAttention", "ProbeHead", "RouterHead", "SimpleAttentionNetwork", "Stack", "conv_taps",
    "engram_indices", "kron_apply", "make_window_mask", "mask_diag", "probe_pool", "shift_right",
]
