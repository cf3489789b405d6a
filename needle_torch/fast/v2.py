"""The fast forms of Needle 2's plain pieces (needle_torch/v2), put in place by seam.fast_paths.

Each form below computes what the piece it replaces computes (up to the order of float32 sums) and falls back to
that piece where it does not apply: compiled CPU graphs take fused multiply-and-sums for few rows, the C++ kernels
of cpu_* for many, the Kronecker form of the Walsh product, unrolled lane mixes; on a CPU without bf16 units bf16
products run as float32 ones on upcast operands (kernels.bf16_path). A request also gets the hooks `prepare` (which
kernels to build, whether steps run through cpu_decode) and `ready` (the cache's extra state).

Shapes: B batch, T length, S keys, H heads, K kv heads, g = H/K, h head dim, n lanes, D d_model, P Hadamard width.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from needle_torch.fast import cpu_decode, kernels
from needle_torch.fast.kernels import (
    as_reduction,
    compiling_for_cpu,
    enabled,
    matmul_nt,
    reduces_when_compiled,
    upcasts,
    walsh_entry,
)
from needle_torch.v2 import lanes, model
from needle_torch.v2.generate import DecodeCache
from needle_torch.v2.model import F32_MIN, FLASH_NEG, HadamardMLP, SimpleAttentionNetwork, silu, walsh_matrix

# ----------------------------------------------------------------------------- attention


def dot_product_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, flash: bool = True,
                          causal: bool = False) -> Tensor:
    """model.dot_product_attention in the form the call takes: fused multiply-and-sums for compiled steps of few
    rows, SDPA's fused bf16 kernel where the CPU has bf16 units, upcast bf16 products where it has none."""
    B, H, T, h = q.shape
    K, S = k.shape[1], k.shape[2]
    reduce = as_reduction(T, q.device)  # a compiled decode step: few queries per row, fused multiply-and-sums
    if q.dtype == torch.float32 and not reduce:  # the plain form is SDPA already
        return _PLAIN["dot_product_attention"](q, k, v, mask, flash, causal)
    # SDPA's bf16 products need bf16 units (kernels.bf16_path); FLASH_NEG: finite in bf16 (F32_MIN rounds to -inf)
    if q.dtype == torch.bfloat16 and flash and compiling_for_cpu(q.device) and not upcasts(q.dtype, q.device) \
            and not reduce:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, FLASH_NEG)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1 / math.sqrt(h),
                                              enable_gqa=H != K)  # (B, H, T, h)
    g = H // K
    qg = q.reshape(B, K, g * T, h)  # (B, K, g·T, h): query heads k·g .. k·g + g-1 read kv head k
    m = mask[:, :, None]  # (B|1, 1, 1, T, S)
    if flash:
        s = matmul_nt(qg, k, torch.float32, reduce).view(B, K, g, T, S) * (1 / math.sqrt(h))  # (B, K, g, T, S)
        p = s.masked_fill(~m, FLASH_NEG).softmax(dim=-1).to(v.dtype).view(B, K, g * T, S)  # (B, K, g·T, S)
        return matmul_nt(p, v.transpose(-1, -2), v.dtype, reduce).view(B, H, T, h)  # (B, H, T, h) in v's dtype
    s = matmul_nt(qg, k, q.dtype, reduce).float().view(B, K, g, T, S) / math.sqrt(h)  # (B, K, g, T, S)
    p = s.masked_fill(~m, F32_MIN).softmax(dim=-1).view(B, K, g * T, S)  # (B, K, g·T, S) float32
    return matmul_nt(p, v.float().transpose(-1, -2), torch.float32, reduce).view(B, H, T, h)  # (B, H, T, h) f32


# ----------------------------------------------------------------------------- Walsh product and Hadamard MLP


def walsh_factors(size: int, dtype: torch.dtype, device=None) -> tuple[Tensor, Tensor]:
    """(A, B), float32, with cast_dtype(H_P) = A ⊗ B: A the unnormalised Sylvester matrix of size a = 2^⌊log2(P)/2⌋
    (entries ±1), B that of size P / a times H_P's entry ±cast_dtype(1/√P) (Sylvester order is Kronecker order:
    H_ab = H_a ⊗ H_b). Exact: every entry of A ⊗ B is ±1 times H_P's entry."""
    a = 1 << ((size.bit_length() - 1) // 2)
    dev = torch.device("cpu" if device is None else device)
    A = model._cached(f"{a}/factor/{dev}", lambda: torch.sign(walsh_matrix(a, torch.float32, device)))
    entry = torch.tensor(walsh_entry(size, dtype), dtype=torch.float32)  # walsh_matrix's cast entry
    B = model._cached(f"{size}/cofactor/{dtype}/{dev}",
                      lambda: torch.sign(walsh_matrix(size // a, torch.float32, device)) * entry.to(dev))
    return A, B


def _upcast_walsh(size: int, dtype: torch.dtype, device) -> Tensor:
    """model._cached_walsh in `dtype`, widened to float32 (the upcast path's operand), built once."""
    return model._cached(f"{size}/{dtype}/{torch.device(device)}/upcast",
                         lambda: walsh_matrix(size, dtype, device).float())


def prepare_walsh(size: int, dtype: torch.dtype, device) -> None:
    """Build every Walsh matrix the fast forms of a compiled step at width `size` in `dtype` may read."""
    model._cached_walsh(size, dtype, device)
    if upcasts(dtype, torch.device(device)):
        _upcast_walsh(size, dtype, device)
    walsh_factors(size, dtype, device)


def walsh_transform(x: Tensor) -> Tensor:
    """model.walsh_transform: compiled for CPU, a step of few rows as one fused reduction, more rows through the
    Kronecker form H_P = A ⊗ B (walsh_factors) in float32, rounded once, with a·(P/a)·(a + P/a) multiply-adds a
    row instead of P²; eager bf16 on a CPU without bf16 units as a float32 product on upcast operands."""
    P = x.shape[-1]
    rows = x.shape[:-1].numel()
    if as_reduction(rows, x.device):  # a compiled decode step: H read once, fused (H = Hᵀ)
        return matmul_nt(x, model._cached_walsh(P, x.dtype, x.device), x.dtype, reduce=True)
    if compiling_for_cpu(x.device):
        A, B = walsh_factors(P, x.dtype, x.device)
        X = x.float().reshape(rows, A.shape[0], B.shape[0])  # (rows, a, P/a): x[i·(P/a) + j] = X[i, j]
        return torch.matmul(A, X @ B).reshape(x.shape).to(x.dtype)  # A, B symmetric
    if upcasts(x.dtype, x.device):
        return (x.float() @ _upcast_walsh(P, x.dtype, x.device)).to(x.dtype)
    return x @ model._cached_walsh(P, x.dtype, x.device)


def hadamard_mlp(self: HadamardMLP, x: Tensor) -> Tensor:
    """HadamardMLP.forward, its Walsh products through the fast walsh_transform."""
    x = F.pad(x, (0, self.d1.shape[0] - self.d_model))  # (B, T, P), zeros past D
    z = model.walsh_transform(self.d1 * x)
    z = model.walsh_transform(silu(self.d2 * z))
    return (self.d3 * z)[..., :self.d_model]  # (B, T, D)


# ----------------------------------------------------------------------------- lane routing


def _logsumexp(z: Tensor, dim: int) -> Tensor:
    """torch.logsumexp (keepdim), written out over the n entries of the (short) axis as max + log Σ exp(z - max),
    so that inductor keeps a layer's 40 Sinkhorn steps in fewer buffers."""
    parts = z.unbind(dim)
    m = parts[0]
    for p in parts[1:]:
        m = torch.maximum(m, p)
    total = None
    for p in parts:
        e = (p - m).exp()
        total = e if total is None else total + e
    return (m + total.log()).unsqueeze(dim)


def sinkhorn(logits: Tensor, iters: int = lanes.SINKHORN_ITERS) -> Tensor:
    """lanes.sinkhorn; compiled for CPU the (n, n) axes move to the front, so that every step runs over the tokens
    as its innermost, contiguous axis (the same steps in the same order)."""
    z = logits.float()
    if not compiling_for_cpu(z.device):
        return _PLAIN["sinkhorn"](z, iters)
    z = z.movedim((-2, -1), (0, 1))  # (n, n, ...): tokens innermost
    for _ in range(iters):
        z = z - _logsumexp(z, 1)
        z = z - _logsumexp(z, 0)
    return z.exp().movedim((0, 1), (-2, -1))


def project(xhat: Tensor, phis: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """lanes.project; a compiled step of few rows as fused multiply-and-sums."""
    reduce = as_reduction(xhat.shape[:-1].numel(), xhat.device)
    return tuple(matmul_nt(xhat, phi, torch.float32, reduce) for phi in phis)


def write_lanes(hres: Tensor, x: Tensor, hpost: Tensor, y: Tensor, dtype: torch.dtype) -> Tensor:
    """lanes.write_lanes; compiled for CPU the n terms of the mix are written out, so that it fuses with its
    neighbours into one pass over the lanes."""
    if not compiling_for_cpu(x.device):
        return _PLAIN["write_lanes"](hres, x, hpost, y, dtype)
    xf = x.float()
    mixed = sum(hres[..., :, j, None] * xf[:, :, None, j, :] for j in range(xf.shape[2]))  # (B, T, n, D)
    return (mixed + hpost[..., None] * y.float()[:, :, None, :]).to(dtype)  # (B, T, n, D)


# ----------------------------------------------------------------------------- cached decoding


@dataclass
class FusedCache(DecodeCache):
    """A DecodeCache whose single steps run through the C++ decode kernels (cpu_decode) with this state."""

    fused: cpu_decode.Fused | None = None

    def rows(self, start: int, stop: int) -> DecodeCache:
        # the kernel's tables point at the whole batch's buffers; only prefills take rows
        return replace(super().rows(start, stop), fused=None)


def decode_step(self: SimpleAttentionNetwork, tokens: Tensor, cache: DecodeCache, pos: int | Tensor,
                last_only: bool = False) -> Tensor:
    """SimpleAttentionNetwork.decode_step; a single step at an int position of a FusedCache through cpu_decode."""
    fused = getattr(cache, "fused", None)
    if fused is None or tokens.shape[1] != 1 or isinstance(pos, Tensor):
        return _PLAIN["decode_step"](self, tokens, cache, pos, last_only)
    hist, hist_valid, rope, mask = self._step_inputs(tokens, cache, pos)
    ek_unit, ev = cpu_decode.engram(fused, hist, hist_valid) if len(self.engrams) else (None, None)
    x = cpu_decode.run_layers(fused, self._embed(tokens).to(self.dtype), self.config.mhc_lanes, mask, *rope, pos,
                              ek_unit, ev)
    return cpu_decode.logits(fused, x)


def new_cache(self: SimpleAttentionNetwork, batch: int, max_len: int, valid: Tensor | None = None,
              sink: Tensor | None = None, kv_window: int = 0) -> DecodeCache:
    """SimpleAttentionNetwork.new_cache, with every Walsh matrix the fast forms of a compiled step may read built
    first: a compiled region cannot build one (the new tensor would escape it), whoever compiles the steps."""
    prepare_walsh(self.config.hada_dim, self.dtype, self.device)
    return _PLAIN["new_cache"](self, batch, max_len, valid, sink, kv_window)


def decode_logits(self: SimpleAttentionNetwork, x: Tensor, weight: Tensor | None) -> Tensor:
    """SimpleAttentionNetwork._decode_logits; compiled few-row products read E in its own dtype (upcast in
    registers)."""
    if as_reduction(x.shape[:-1].numel(), x.device):
        return matmul_nt(x, self.embedding.weight, torch.float32, reduce=True)
    return matmul_nt(x, self.embedding.weight if weight is None else weight, torch.float32)


def prepare(net: SimpleAttentionNetwork, batch: int, steps_compiled: bool, prefill_compiled: bool) -> bool:
    """True where a request's compiled steps run through cpu_decode (its kernel is built on first use)."""
    return steps_compiled and cpu_decode.applies(net, batch)


def ready(net: SimpleAttentionNetwork, cache: DecodeCache, traced: bool, fused: bool) -> DecodeCache:
    """The request's cache with the fast forms' state: cpu_decode's tables (a FusedCache) where `fused`, and no
    float32 copy of E where traced steps read E in place."""
    if traced and reduces_when_compiled(cache.hist.shape[0], net.device):
        cache.logits_weight = None
    if not fused or not enabled():
        return cache
    fields = {f: getattr(cache, f) for f in cache.__dataclass_fields__}
    return FusedCache(**fields, fused=cpu_decode.fuse(net, cache.k, cache.v, cache.offsets, FLASH_NEG))


def module_swaps(net: nn.Module) -> list:
    """No module of Needle 2 changes class besides its nn.Linear (seam.fast_paths)."""
    return []


# The plain pieces, and what replaces them inside fast_paths: (owner, attribute, fast form).
_PLAIN = {"dot_product_attention": model.dot_product_attention, "sinkhorn": lanes.sinkhorn,
          "write_lanes": lanes.write_lanes, "decode_step": SimpleAttentionNetwork.decode_step,
          "new_cache": SimpleAttentionNetwork.new_cache}
SWAPS = (
    (model, "dot_product_attention", dot_product_attention),
    (model, "walsh_transform", walsh_transform),
    (HadamardMLP, "forward", hadamard_mlp),
    (lanes, "sinkhorn", sinkhorn),
    (lanes, "project", project),
    (model, "project", project),
    (lanes, "write_lanes", write_lanes),
    (model, "write_lanes", write_lanes),
    (SimpleAttentionNetwork, "new_cache", new_cache),
    (SimpleAttentionNetwork, "decode_step", decode_step),
    (SimpleAttentionNetwork, "_decode_logits", decode_logits),
)
LINEAR = kernels.Linear  # the class the model's nn.Linear modules take inside fast_paths (packed oneDNN products)


# ----------------------------------------------------------------------------- the pieces, registered once


@dataclass(frozen=True)
class Piece:
    """One fast piece: the request it serves (benchmarks/bench_fast_pieces.py REQUESTS) and the (owner, attribute,
    value) settings that switch it off (seam.without), leaving the rest of the fast path in place."""

    serves: str
    off: tuple[tuple[object, str, object], ...]


def _never(*args, **kwargs) -> bool:
    return False


_NO_DECODE_KERNELS = ((cpu_decode, "MAX_ROWS", 0), (cpu_decode, "BF16_MAX_ROWS", 0))
# Each kept piece, measured against plain + torch.compile on the request it serves; removing a piece is deleting its
# line here and the code it names.
PIECES = {
    "cpu_decode": Piece("bf16-b1-steps", _NO_DECODE_KERNELS),
    "cpu_decode_f32": Piece("f32-b1-steps", _NO_DECODE_KERNELS),
    "reductions": Piece("bf16-b1-steps", (*_NO_DECODE_KERNELS, (kernels, "REDUCE_MAX_ROWS", 0))),
    "onednn_f32": Piece("f32-many-steps", ((kernels, "_onednn_f32", _never),)),
    "linear": Piece("f32-many-steps", ((sys.modules[__name__], "LINEAR", None),)),
    "walsh_forms": Piece("f32-many-all", ((sys.modules[__name__], "SWAPS",
                                           tuple(s for s in SWAPS if s[1] != "walsh_transform")),)),
    "prefill_chunks": Piece("bf16-many-eager", ((kernels, "PREFILL_TOKENS", 1 << 30),)),
}
