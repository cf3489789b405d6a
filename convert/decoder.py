"""What the Needle 2 and Needle 3 configs share: the engram and Hadamard sizes, the KV budget, their invariants.

Framework-free on purpose: importing it pulls in neither torch nor jax. Both families' `TransformerConfig`
mix in `DecoderSizes` and call `check_decoder` from their `check()`; the notation is NEEDLE_V2.md's.
"""

from __future__ import annotations

from convert.errors import ConfigError

ENGRAM_SUB_DIM = 128  # the sub-dim the engram head count is derived from
ENGRAM_TAPS = 4  # the engram value conv's taps
KV_BUDGET_BYTES = 11 * 2**20 + 2**19  # what upstream's kv_budget_window fits the int8 cache into
KV_GROUP, KV_WINDOW_MIN = 32, 160  # int8 scale groups; the budget's floor (which may exceed max_seq_len: upstream's)


class DecoderSizes:
    """Derived sizes both decoder families define alike (fields: d_model, engram_*, kv_window)."""

    @property
    def engram_heads_resolved(self) -> int:  # E
        return self.engram_heads or max(1, self.d_model // (len(self.engram_orders) * ENGRAM_SUB_DIM))

    @property
    def num_engram_tables(self) -> int:  # N = |O|·E, table k = oi·E + e (order-major)
        return len(self.engram_orders) * self.engram_heads_resolved

    @property
    def engram_sub_dim(self) -> int:  # s
        return self.d_model // self.num_engram_tables

    @property
    def engram_dilation(self) -> int:  # the value conv's dilation: max(O)
        return max(self.engram_orders)

    @property
    def num_sites(self) -> int:  # G
        return len(self.engram_layers)

    @property
    def hada_dim(self) -> int:  # P: the smallest power of two >= D
        return 1 << (self.d_model - 1).bit_length()

    @property
    def effective_kv_window(self) -> int:
        """Upstream's `effective_kv_window` (the .cact header's): min(budget, kv_window), or the budget."""
        budget = self.kv_budget_window
        return min(budget, self.kv_window) if self.kv_window else budget


def kv_budget(per_position: int, max_seq_len: int) -> int:
    """The positions an int8 cache of `per_position` bytes fits into KV_BUDGET_BYTES, in steps of KV_GROUP."""
    window = KV_BUDGET_BYTES // per_position // KV_GROUP * KV_GROUP
    return max(KV_WINDOW_MIN, min(window, max_seq_len))


def int8_bytes(width: int) -> int:
    """Bytes an int8-cached row of `width` takes: the codes and one float32 scale per KV_GROUP."""
    return width + (width // KV_GROUP) * 4


def check_decoder(config) -> None:
    """Raise ConfigError for what both decoder families refuse alike, naming the field and the fix."""
    if not config.rope_theta > 0:
        raise ConfigError(f"config.rope_theta must be > 0, got {config.rope_theta}")
    if not 0 <= config.pad_token_id < config.vocab_size:
        raise ConfigError(f"config.pad_token_id={config.pad_token_id} is outside the vocabulary "
                          f"[0, {config.vocab_size})")
    if not config.engram_orders or min(config.engram_orders) < 1:
        raise ConfigError(f"config.engram_orders={list(config.engram_orders)} must be a non-empty list of n-gram "
                          "orders >= 1, e.g. [2, 3]")
    if config.engram_sub_dim < 1:
        raise ConfigError(f"config.engram_heads={config.engram_heads} with {len(config.engram_orders)} orders makes "
                          f"{config.num_engram_tables} tables wider than d_model={config.d_model}; use fewer heads")
    sites, n = list(config.engram_layers), config.num_layers
    outside = [i for i in sites if not 0 <= i < n]
    if outside:
        raise ConfigError(f"config.engram_layers={sites} has layer(s) {outside} outside the {n} layers (upstream "
                          f"asserts each < num_layers); use indices 0..{n - 1}")
    repeated = sorted({i for i in sites if sites.count(i) > 1})
    if repeated:
        # Upstream's forward adds such a site once per entry but its cached decoding once: the two would disagree.
        raise ConfigError(f"config.engram_layers={sites} repeats layer(s) {repeated}; list each engram site once")
