"""The Needle 2 config (upstream's `TransformerConfig`, NEEDLE_V2.md §1), shared by both v2 twins and the converter.

Framework-free on purpose: importing it pulls in neither torch nor jax.

Upstream's class takes keyword arguments only, keeps the ones that name a field, silently
drops every other key, and resolves `attn_dim = attn_dim or d_model`. We differ on the
dropped keys on purpose: keys upstream no longer knows (older checkpoints carry e.g.
`batch_size`, `qk_head_dim`) are kept verbatim in `extras`, so a round trip gives the file
back and `inspect` can list them; they never reach the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from convert.decoder import ENGRAM_TAPS, DecoderSizes, check_decoder, int8_bytes, kv_budget
from convert.fields import FamilyConfig, check_heads, positive

# Special token ids (NEEDLE_V2.md §8): PAD, EOS, BOS, UNK, then the ten chat markers.
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tools>", "</tools>", "<tool_call>",
                "</tool_call>", "<tool_result>", "</tool_result>")
MARKER_IDS = {marker: 4 + i for i, marker in enumerate(CHAT_MARKERS)}
FIRST_PLAIN_ID = 4 + len(CHAT_MARKERS)  # 14: the first id of an ordinary piece



@dataclass(frozen=True)
class TransformerConfig(DecoderSizes, FamilyConfig):
    """Needle 2 hyper-parameters: upstream's fields, in upstream's order, with upstream's defaults.

    `attn_dim` is resolved as upstream resolves it (0 -> d_model). Invariants upstream asserts (engram sites
    inside the stack) and ones where upstream's two code paths would disagree (a repeated engram site: the
    forward adds it twice, decode once) are refused with the field and the fix.
    """

    family = "v2"
    keeps_unknown = True

    vocab_size: int = 8192
    d_model: int = 512
    attn_dim: int = 0
    num_heads: int = 8
    num_kv_heads: int = 4
    num_layers: int = 12
    max_seq_len: int = 2048
    pad_token_id: int = 0
    contrastive_dim: int = 128
    rope_theta: float = 100000.0
    dtype: str = "bfloat16"
    flash: bool = True
    engram_orders: tuple[int, ...] = (2, 3)
    engram_heads: int = 0
    engram_slots: int = 8192
    engram_layers: tuple[int, ...] = (2, 15)
    mhc_lanes: int = 4
    kv_window: int = 0
    kv_bits: int = 8
    act_bits: int = 8
    weight_bits: str = ""
    remat: bool = True
    scan_unroll: int = 1
    # Keys upstream's class does not know, as (key, value) pairs in the order given: never used by the model.
    extras: tuple[tuple[str, Any], ...] = field(default=(), compare=False, hash=False)

    def check(self) -> None:
        if not self.attn_dim:  # upstream's __init__: attn_dim = attn_dim or d_model
            object.__setattr__(self, "attn_dim", self.d_model)
        positive(self, ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "max_seq_len",
                        "contrastive_dim", "engram_slots", "mhc_lanes", "scan_unroll"))
        positive(self, ("attn_dim", "engram_heads", "kv_window"), minimum=0)
        check_heads("attn_dim", self.attn_dim, self.num_heads, self.num_kv_heads)
        super().check()
        check_decoder(self)

    def upstream_dict(self) -> dict[str, Any]:
        """As upstream's trainer pickles `config.__dict__`: the fields that differ from the defaults, plus attn_dim
        and engram_layers (upstream's __init__ always sets those two), then any kept unknown keys."""
        out = self.to_dict(only_non_default=True)
        out.pop("attn_dim", None)
        out.pop("engram_layers", None)
        for key in self.extra_keys():
            out.pop(key)
        return {**out, "attn_dim": self.attn_dim, "engram_layers": self.engram_layers, **self.extra_keys()}

    # ------------------------------------------------------------------ derived sizes (notation of NEEDLE_V2.md)

    @property
    def head_dim(self) -> int:  # h
        return self.attn_dim // self.num_heads

    @property
    def kv_dim(self) -> int:  # K·h
        return self.num_kv_heads * self.head_dim

    @property
    def engram_history(self) -> int:  # W = 4·max(O): tokens of history cached decoding hashes
        return ENGRAM_TAPS * self.engram_dilation

    @property
    def kv_budget_window(self) -> int:
        """Upstream's `kv_budget_window`: the positions an int8 cache of every layer and engram site fits."""
        return kv_budget(self.num_layers * 2 * int8_bytes(self.kv_dim) + self.num_sites * int8_bytes(self.d_model),
                         self.max_seq_len)


# Upstream's PRESETS (NEEDLE_V2.md §1): plain dicts of keyword arguments.
PRESETS: dict[str, dict[str, Any]] = {
    "needle": {"d_model": 768, "num_heads": 12, "num_kv_heads": 6, "num_layers": 27, "engram_layers": (2, 15)},
    "base": {"d_model": 512, "num_heads": 8, "num_kv_heads": 4, "num_layers": 27, "engram_layers": (2, 15)},
}

# The published "45M" Needle 2 is the `base` preset (NEEDLE_V2.md §1): 44,938,997 parameters with MTP.
NEEDLE_V2_PUBLISHED = TransformerConfig(**PRESETS["base"])
