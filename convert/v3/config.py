"""The Needle 3 config (upstream's `TransformerConfig`, NEEDLE_V3.md §1), shared by both v3 twins and the converter.

Framework-free on purpose: importing it pulls in neither torch nor jax.

Three ways to build one, as upstream has three:
- `TransformerConfig(...)`: the class defaults (upstream's `TransformerConfig(**fields)` without `attn_dim`);
- `TransformerConfig.from_kwargs(**kw)`: upstream's constructor exactly, the legacy `attn_dim` keyword included;
- `TransformerConfig.from_saved(d)` / `from_dict(d)`: upstream's loader rule, where a *missing* feature key means
  "off" (no conv taps, no window, head dims D//H, ...), and a Needle 2 config is refused by name.

Keys upstream does not know are kept verbatim in `extras` (never used by the model), as for Needle 2.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from convert.decoder import ENGRAM_TAPS as ENGRAM_TAPS  # the twins' model files read it here
from convert.decoder import KV_BUDGET_BYTES, KV_GROUP, KV_WINDOW_MIN, DecoderSizes, check_decoder, int8_bytes, kv_budget
from convert.errors import ConfigError
from convert.fields import FamilyConfig, positive

# Special token ids (NEEDLE_V3.md §8): PAD, EOS, BOS, UNK, then the chat markers.
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
CHAT_MARKERS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tools>", "</tools>", "<tool_call>",
                "</tool_call>", "<tool_result>", "</tool_result>", "<context>", "</context>", "<extract>",
                "</extract>", "<schema>", "</schema>")

HADA_COND_RANK = 8  # the Monarch MLP's low-rank conditioning width

# upstream's from_saved: a feature key missing from a saved config means "off", not the class default.
_OFF_WHEN_MISSING = (("qk_head_dim", 0), ("v_head_dim", 0), ("sliding_window", 0), ("global_layers", ()),
                     ("ladder_depths", ()), ("ladder_sample", False), ("ladder_widths", ()), ("ladder_order", ()),
                     ("engram_seed_heads", 0), ("qkv_conv_taps", 0), ("out_vocab", 0))


@dataclass(frozen=True)
class TransformerConfig(DecoderSizes, FamilyConfig):
    """Needle 3 hyper-parameters: upstream's fields, in upstream's order, with upstream's defaults.

    Head dims of 0 resolve to d_model // num_heads (`head_dims`), as upstream resolves them. Invariants upstream
    asserts or that would break one of its code paths are refused with the field and the fix.
    """

    family = "v3"
    keeps_unknown = True

    vocab_size: int = 16384
    d_model: int = 768
    num_heads: int = 12
    num_kv_heads: int = 2
    num_layers: int = 20
    qk_head_dim: int = 48
    v_head_dim: int = 64
    max_seq_len: int = 4096
    pad_token_id: int = 0
    embedding_dim: int = 128
    embedding_probes: int = 4
    embedding_queries: int = 4
    confidence_probes: int = 4
    confidence_queries: int = 4
    router_probes: int = 4
    router_queries: int = 4
    rope_theta: float = 100000.0
    dtype: str = "bfloat16"
    flash: bool = True
    engram_orders: tuple[int, ...] = (2, 3)
    engram_heads: int = 0
    engram_slots: int = 18432
    engram_seed_heads: int = 0
    engram_layers: tuple[int, ...] = (3, 7, 11, 15, 19)
    global_layers: tuple[int, ...] = (4, 9, 14, 19)
    sliding_window: int = 1024
    ladder_depths: tuple[int, ...] = ()
    ladder_sample: bool = False
    ladder_widths: tuple[int, ...] = ()
    ladder_order: tuple[int, ...] = ()
    mhc_lanes: int = 4
    qkv_conv_taps: int = 3
    out_vocab: int = 0
    kv_window: int = 0
    kv_bits: int = 8
    act_bits: int = 8
    weight_bits: str = ""
    remat: bool = True
    scan_unroll: int = 1
    # Keys upstream's class does not know, as (key, value) pairs in the order given: never used by the model.
    extras: tuple[tuple[str, Any], ...] = field(default=(), compare=False, hash=False)

    # ------------------------------------------------------------------ construction, as upstream's

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> TransformerConfig:
        """Upstream's constructor: unknown keys kept aside, and a truthy legacy `attn_dim` sets both head dims to
        attn_dim // num_heads and turns the window and global layers off, each only where not passed."""
        legacy = kwargs.get("attn_dim", 0)
        if legacy:
            heads = kwargs.get("num_heads", cls.num_heads)
            for key, value in (("qk_head_dim", legacy // heads), ("v_head_dim", legacy // heads),
                               ("sliding_window", 0), ("global_layers", ())):
                kwargs.setdefault(key, value)
        return super().from_dict(kwargs)

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> TransformerConfig:
        """Upstream's `from_saved` (what its loader uses): missing feature keys are "off", the rest defaults."""
        if not isinstance(saved, Mapping):
            raise ConfigError(f"config must be a dict of fields, got {type(saved).__name__}")
        if "attn_dim" in saved and "qk_head_dim" not in saved:
            raise ConfigError("this config has attn_dim and no qk_head_dim: it is a Needle 2 (v2) config, not a "
                              "Needle 3 one; read the file as Needle 2 (convert.v2.TransformerConfig)")
        saved = {k: v for k, v in saved.items() if k != "attn_dim"}  # with qk_head_dim present, upstream ignores it
        for key, off in _OFF_WHEN_MISSING:
            saved.setdefault(key, off)
        return super().from_dict(saved)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransformerConfig:
        """A config stored in a checkpoint: upstream's loader rule (`from_saved`)."""
        return cls.from_saved(d)

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        positive(self, ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "max_seq_len",
                        "embedding_dim", "embedding_probes", "embedding_queries", "confidence_probes",
                        "confidence_queries", "router_probes", "router_queries", "engram_slots", "mhc_lanes",
                        "scan_unroll"))
        positive(self, ("qk_head_dim", "v_head_dim", "engram_heads", "engram_seed_heads", "sliding_window",
                        "qkv_conv_taps", "out_vocab", "kv_window"), minimum=0)
        super().check()
        hq, hv = self.head_dims
        if not (self.qk_head_dim and self.v_head_dim) and self.d_model % self.num_heads:
            raise ConfigError(f"config.d_model={self.d_model} is not divisible by num_heads={self.num_heads}, and a "
                              "head dim of 0 means d_model // num_heads; set qk_head_dim and v_head_dim")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"config.num_heads={self.num_heads} is not divisible by num_kv_heads="
                              f"{self.num_kv_heads}; pick a divisor of num_heads")
        if hq % 2:
            raise ConfigError(f"config qk head dim {hq} is odd; half-split RoPE needs an even qk_head_dim")
        if self.out_vocab > self.vocab_size:
            raise ConfigError(f"config.out_vocab={self.out_vocab} exceeds vocab_size={self.vocab_size}; use at most "
                              "vocab_size (0: every row)")
        # Global layers past the stack are not refused: upstream ignores them (the class default names layer 19).
        check_decoder(self)
        if self.ladder_order and sorted(self.ladder_order) != list(range(self.num_layers)):
            raise ConfigError(f"config.ladder_order={list(self.ladder_order)} is not a permutation of the "
                              f"{self.num_layers} layers; give each of 0..{self.num_layers - 1} once, or [] for the "
                              "bisection order")

    def upstream_dict(self) -> dict[str, Any]:
        """The config dict we write into an upstream file: every field, so upstream's `from_saved` (which turns a
        missing feature key off) rebuilds exactly this config; then any kept unknown keys."""
        return self.to_dict()

    # ------------------------------------------------------------------ derived sizes (notation of NEEDLE_V3.md)

    @property
    def head_dims(self) -> tuple[int, int]:  # (hq, hv): upstream's head_dims(); 0 -> D // H
        fallback = self.d_model // self.num_heads
        return self.qk_head_dim or fallback, self.v_head_dim or fallback

    @property
    def engram_seed_stride(self) -> int:  # σ: table (oi, e) hashes with seed 0x9E3779B9·(oi·σ + e + 1)
        return self.engram_seed_heads or self.engram_heads_resolved

    @property
    def hada_blocks(self) -> tuple[int, int]:  # (a, b) with a·b = P: the Monarch factors' sizes
        return hada_blocks(self.hada_dim)

    @property
    def output_vocab(self) -> int:  # the logits' width: out_vocab, else V
        return self.out_vocab or self.vocab_size

    @property
    def kv_budget_window(self) -> int:
        """Upstream's `kv_budget_window` (NEEDLE_V3.md §5): the positions an int8 cache fits into 11.5 MiB; with a
        sliding window, local layers and engram sites take their window first and global layers share the rest."""
        hq, hv = self.head_dims
        per_layer = int8_bytes(self.num_kv_heads * hq) + int8_bytes(self.num_kv_heads * hv)
        per_site = self.num_sites * int8_bytes(self.d_model)
        if not self.sliding_window:
            return kv_budget(self.num_layers * per_layer + per_site, self.max_seq_len)
        n_global = len(self.global_layers)
        local = min(self.sliding_window, self.max_seq_len)
        fixed = ((self.num_layers - n_global) * per_layer + per_site) * local
        if n_global == 0:
            return self.max_seq_len if fixed <= KV_BUDGET_BYTES else max(KV_WINDOW_MIN, local)
        ctx = (KV_BUDGET_BYTES - fixed) // (n_global * per_layer) // KV_GROUP * KV_GROUP
        return max(KV_WINDOW_MIN, min(ctx, self.max_seq_len))


def hada_blocks(n: int) -> tuple[int, int]:
    """Upstream's `_hada_blocks`: (a, b), a = 2^(⌊log2(n-1)+1⌋ // 2), b = n / a."""
    a = 1 << ((n - 1).bit_length() // 2)
    return a, n // a


HADA_PERM_SEEDS = (11, 13)


def hada_perms(n: int, split: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The Monarch MLP's two fixed gathers (upstream's `_hada_perms`): numpy RandomState(11) and (13) permutations
    of n; split (a config with ladder_widths) permutes each half within itself, the upper with seed + 977."""
    if split:
        h = n // 2
        return tuple(np.concatenate([np.random.RandomState(s).permutation(h),
                                     h + np.random.RandomState(s + 977).permutation(h)]) for s in HADA_PERM_SEEDS)
    return tuple(np.random.RandomState(s).permutation(n) for s in HADA_PERM_SEEDS)


def walsh_matrix(n: int) -> np.ndarray:
    """The normalised Walsh–Hadamard matrix H_n / √n (float32), the Monarch factors' init."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def head_dims(config: TransformerConfig) -> tuple[int, int]:
    """Upstream's `head_dims(config)`: (qk_head_dim, v_head_dim) with 0 resolved to d_model // num_heads."""
    return config.head_dims


def engram_geometry(config: TransformerConfig) -> tuple[tuple[int, ...], int, int]:
    """Upstream's `engram_geometry(config)`: (orders, engram heads E, sub_dim s)."""
    return tuple(config.engram_orders), config.engram_heads_resolved, config.engram_sub_dim


# The class defaults: what `cactus-needle` 3.x builds when nothing is passed (127,240,240 params plain).
NEEDLE_V3_DEFAULT = TransformerConfig()
