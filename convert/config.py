"""The one Needle v1 config, shared by both twins, the converter and the CLI.

Framework-free on purpose: importing it pulls in neither torch nor jax.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from convert.errors import ConfigError

ACTIVATIONS = ("drelu", "swiglu", "geglu")
DTYPES = ("float32", "bfloat16", "float16")

# Special token ids (upstream tokenizer).
PAD_ID, EOS_ID, BOS_ID, UNK_ID, TOOL_CALL_ID, TOOLS_ID = 0, 1, 2, 3, 4, 5
SPECIAL_IDS = (PAD_ID, EOS_ID, BOS_ID, UNK_ID, TOOL_CALL_ID, TOOLS_ID)
FIRST_PLAIN_ID = len(SPECIAL_IDS)  # the first id of an ordinary piece


@dataclass(frozen=True)
class TransformerConfig:
    """Needle v1 hyper-parameters: exactly upstream's fields and defaults.

    Upstream pickles store only the fields passed explicitly when the model was
    built; `TransformerConfig(**partial)` fills the rest with upstream defaults.
    """

    vocab_size: int = 8192
    d_model: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    d_ff: int = 512
    max_seq_len: int = 128
    pad_token_id: int = 0
    rope_theta: float = 10000.0
    dtype: str = "bfloat16"
    activation: str = "drelu"
    num_memory_slots: int = 64
    dropout_rate: float = 0.1
    contrastive_dim: int = 128
    no_feedforward: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, _coerce(f.name, f.type, getattr(self, f.name)))
        positive = ("vocab_size", "d_model", "num_heads", "num_kv_heads", "d_ff", "max_seq_len", "contrastive_dim")
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_encoder_layers", "num_decoder_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config.{name} must be >= 1 (nn.scan needs a layer), got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ConfigError(
                f"config.d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                f"pick num_heads from {_divisors(self.d_model)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"config.num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}; "
                f"pick num_kv_heads from {_divisors(self.num_heads)}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"config head_dim = d_model/num_heads = {self.head_dim} is odd; half-split RoPE needs an even head_dim"
            )
        if self.d_model < 4:
            raise ConfigError(f"config.d_model must be >= 4 (contrastive head is d_model//4), got {self.d_model}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"config.activation={self.activation!r} is unknown; use one of {', '.join(ACTIVATIONS)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"config.dtype={self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ConfigError(f"config.dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(
                f"config.pad_token_id={self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransformerConfig:
        """Build from a (possibly partial) upstream config dict; unknown keys are an error."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a dict of fields, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(
                f"unknown config key(s) {', '.join(map(repr, unknown))}; "
                f"Needle v1 fields are: {', '.join(sorted(known))}"
            )
        return cls(**dict(d))

    def to_dict(self, *, only_non_default: bool = False) -> dict[str, Any]:
        """All fields, or (as upstream pickles store them) only the non-default ones."""
        out = dataclasses.asdict(self)
        if only_non_default:
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            out = {k: v for k, v in out.items() if v != defaults[k]}
        return out

    def differences(self, other: TransformerConfig) -> dict[str, tuple[Any, Any]]:
        """{field: (self's value, other's)} for the fields that differ."""
        mine, theirs = self.to_dict(), other.to_dict()
        return {k: (v, theirs[k]) for k, v in mine.items() if v != theirs[k]}

    def replace(self, **changes: Any) -> TransformerConfig:
        return dataclasses.replace(self, **changes)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def total_layers(self) -> int:
        return self.num_encoder_layers + self.num_decoder_layers


def _coerce(name: str, kind: str, value: Any) -> Any:
    """Accept numpy scalars from pickles; refuse lossy or wrong-kind values."""
    if kind == "bool":
        if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
            return bool(value)
        raise ConfigError(f"config.{name} must be true or false, got {value!r}")
    if kind == "int":
        if isinstance(value, bool):
            raise ConfigError(f"config.{name} must be an integer, got {value!r}")
        try:
            return operator.index(value)
        except TypeError:
            raise ConfigError(f"config.{name} must be an integer, got {value!r}") from None
    if kind == "float":
        if isinstance(value, bool) or isinstance(value, str):
            raise ConfigError(f"config.{name} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config.{name} must be a number, got {value!r}") from None
    if not isinstance(value, str):
        raise ConfigError(f"config.{name} must be a string, got {value!r}")
    return value


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


# The published Needle v1 model (NEEDLE_V1.md, "Real size"): 26,315,421 parameters.
NEEDLE_V1_PUBLISHED = TransformerConfig(
    vocab_size=8192,
    d_model=512,
    num_heads=8,
    num_kv_heads=4,
    num_encoder_layers=12,
    num_decoder_layers=8,
)


def count_parameters(config: TransformerConfig) -> int:
    """Parameter count of a Needle v1 model, from the config alone."""
    D, h, Kh = config.d_model, config.head_dim, config.num_kv_heads * config.head_dim
    attn = 2 * D * D + 2 * D * Kh + 2 * h
    ffn = 0 if config.no_feedforward else 3 * D * config.d_ff + D + 1
    enc = config.num_encoder_layers * (D + 1 + attn + ffn)
    dec = config.num_decoder_layers * (2 * (D + 1 + attn) + ffn)
    contrastive = D * (D // 4) + D // 4 + (D // 4) * config.contrastive_dim
    return config.vocab_size * D + enc + D + dec + D + contrastive + 1
