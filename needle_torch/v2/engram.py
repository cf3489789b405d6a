"""Needle 2's hashed n-gram memory (NEEDLE_V2.md §3.6) in torch: the hash, its validity masks and one site.

The twin of needle_flax/v2/engram.py. Upstream hashes in uint32 wrap-around arithmetic; torch
has no dependable uint32 multiply, so the hash runs in int64 and is reduced mod 2^32 after
every multiply (products stay below 2^57), and the final shift acts on the reduced, hence
non-negative, value, which makes torch's arithmetic shift the logical one upstream uses.

Shapes: B batch, T length, D d_model, O the n-gram orders, E engram heads, N = |O|·E tables (order-major), S
slots per table, s sub_dim (N·s <= D).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convert.v2.config import ENGRAM_TAPS, TransformerConfig
from needle_torch.v2.lanes import aq

HASH_SEED = 0x9E3779B9  # table k starts from (SEED · (k + 1)) mod 2^32
HASH_PRIME = 0x01000193  # FNV-1a's 32-bit prime
HASH_SHIFT = 15
MASK32 = 0xFFFFFFFF


def shift_right(valid: Tensor, offset: int) -> Tensor:
    """valid moved `offset` steps later on the time axis (axis 1), False/zeros shifted in at the start: (B, T)."""
    return F.pad(valid, (offset, 0))[:, :valid.shape[1]]


def mask_diag(mask: Tensor, offset: int) -> Tensor:
    """diag_o[b, t] = mask[b, 0, t, t - o], False where t < o: may position t see position t - o? (B|1, 1, T, T)
    -> (B|1, T)."""
    m = mask[:, 0]  # (B|1, T, T)
    B, T, _ = m.shape
    if offset >= T:
        return m.new_zeros((B, T))
    d = torch.diagonal(m, offset=-offset, dim1=1, dim2=2)  # (B, T - o)
    return torch.cat([d.new_zeros((B, offset)), d], dim=1)  # (B, T)


def engram_indices(tokens: Tensor, config: TransformerConfig, stride: int | None = None) -> Tensor:
    """Table rows idx (B, T, N) int64 of upstream's `engram_indices`: table k = oi·E + e (order-major), order o.

    acc = SEED·(oi·σ + e + 1) (σ = stride; None: E, Needle 2's); for j in 0..o-1: acc = (acc XOR u[t-j])·PRIME
    (u = 0 before the start: those zeros are hashed, not skipped; the masks remove them later); acc ^= acc >> 15;
    idx = acc mod S. All mod 2^32."""
    orders, E, S = tuple(config.engram_orders), config.engram_heads_resolved, config.engram_slots
    B, T = tokens.shape
    far = max(orders) - 1
    u = F.pad(tokens.long() & MASK32, (far, 0))  # (B, far + T): u[t - j] is column far + t - j
    cols = []
    for oi, order in enumerate(orders):
        k = oi * (E if stride is None else stride) + torch.arange(E, device=tokens.device)  # (E,) seeds' k
        acc = ((HASH_SEED * (k + 1)) & MASK32).expand(B, T, E)  # (B, T, E)
        for j in range(order):
            prev = u[:, far - j:far - j + T, None]  # (B, T, 1): the token j steps back
            acc = ((acc ^ prev) * HASH_PRIME) & MASK32
        acc = acc ^ (acc >> HASH_SHIFT)
        cols.append(acc % S)
    return torch.cat(cols, dim=-1)  # (B, T, N)


def engram_masks(mask: Tensor, config: TransformerConfig) -> tuple[Tensor, Tensor]:
    """(ngram_ok (B, T, N), tap_ok (4, B, T)) bool, read off the attention mask (B|1, 1, T|1, T).

    ngram_ok[..., k] = diag_{o-1} for table k's order o; tap_ok[j] = diag_{j·max(O)}. B is the mask's (1 for
    the default causal mask: broadcast over the batch). The masks inherit padding, windows and packing."""
    T = mask.shape[-1]
    m = mask.expand(mask.shape[0], 1, T, T)  # (B, 1, T, T)
    E, dil = config.engram_heads_resolved, config.engram_dilation
    ngram = [mask_diag(m, order - 1) for order in config.engram_orders for _ in range(E)]
    taps = [mask_diag(m, j * dil) for j in range(ENGRAM_TAPS)]
    return torch.stack(ngram, dim=-1), torch.stack(taps, dim=0)


class Engram(nn.Module):
    """One engram site (`engrams_{g}`): gather N table rows, project to a key and a value, dilated causal taps."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        N, S, s, D = config.num_engram_tables, config.engram_slots, config.engram_sub_dim, config.d_model
        self.dilation = config.engram_dilation
        self.embedding = nn.Parameter(torch.empty(N, S, s))
        self.key_proj = nn.Linear(N * s, D, bias=False)
        self.value_proj = nn.Linear(N * s, D, bias=False)
        self.taps = nn.Parameter(torch.empty(ENGRAM_TAPS, D))

    def forward(self, idx: Tensor, ngram_ok: Tensor, tap_ok: Tensor, quant: bool | Tensor = False,
                last: int | None = None) -> tuple[Tensor, Tensor]:
        """idx (B, T, N), ngram_ok (B|1, T, N), tap_ok (4, B|1, T) -> key, value, each (B, T, D) in the param dtype.

        last: only the last `last` rows of key and value (cached decoding: the rows before are the token history
        the taps and n-grams read, W = 4·max(O) of them); their values are the same as the full result's."""
        N, S, s = self.embedding.shape
        B, T, _ = idx.shape
        rows = idx + torch.arange(N, device=idx.device) * S  # (B, T, N): rows of the flattened tables
        f = F.embedding(rows, self.embedding.reshape(N * S, s))  # (B, T, N, s)
        f = f * ngram_ok[..., None].to(f.dtype)
        e = aq(f.reshape(B, T, N * s), quant)  # (B, T, N·s), table-major
        lo = 0 if last is None else T - last  # the first row returned
        key = self.key_proj(e[:, lo:])
        shifted = self._tapped_values(e, lo)  # per tap j: v[t - j·dil] for t in lo..T-1, (B, T - lo, D) each
        taps = self.taps.to(shifted[0].dtype)
        val = None
        for j in range(ENGRAM_TAPS):  # val[t] = Σ_j taps[j] ⊙ v[t - j·dil] · tap_ok[j][t], v before the start = 0
            term = taps[j] * shifted[j] * tap_ok[j][:, lo:, None].to(shifted[j].dtype)
            val = term if val is None else val + term
        return key, val

    def _tapped_values(self, e: Tensor, lo: int) -> list[Tensor]:
        """v = value_proj(e) (B, T, D) shifted by each tap: [v[t - j·dil] for t in lo..T-1] for j < 4, zeros before
        the start."""
        T = e.shape[1]
        v = self.value_proj(e)
        return [v[:, lo:] if j == 0 else F.pad(v, (0, 0, j * self.dilation, 0))[:, lo:T] for j in range(ENGRAM_TAPS)]


__all__ = ["HASH_PRIME", "HASH_SEED", "Engram", "engram_indices", "engram_masks", "mask_diag", "shift_right"]
