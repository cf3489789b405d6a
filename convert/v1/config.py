"""The Needle v1 config, shared by both v1 twins, the converter and the CLI.

Framework-free on purpose: importing it pulls in neither torch nor jax.
"""

from __future__ import annotations

from dataclasses import dataclass

from convert.errors import ConfigError
from convert.fields import FamilyConfig, check_heads, positive

ACTIVATIONS = ("drelu", "swiglu", "geglu")

# Special token ids (upstream v1 tokenizer).
PAD_ID, EOS_ID, BOS_ID, UNK_ID, TOOL_CALL_ID, TOOLS_ID = 0, 1, 2, 3, 4, 5
SPECIAL_IDS = (PAD_ID, EOS_ID, BOS_ID, UNK_ID, TOOL_CALL_ID, TOOLS_ID)
FIRST_PLAIN_ID = len(SPECIAL_IDS)  # the first id of an ordinary piece


@dataclass(frozen=True)
class TransformerConfig(FamilyConfig):
    """Needle v1 hyper-parameters: exactly upstream's fields and defaults.

    Upstream pickles store only the fields passed explicitly when the model was
    built; `TransformerConfig(**partial)` fills the rest with upstream defaults.
    Unknown keys are an error (v1 checkpoints carry none).
    """

    family = "v1"

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

    def check(self) -> None:
        positive(self, ("vocab_size", "d_model", "num_heads", "num_kv_heads", "d_ff", "max_seq_len", "contrastive_dim"))
        positive(self, ("num_encoder_layers", "num_decoder_layers"), why=" (nn.scan needs a layer)")
        check_heads("d_model", self.d_model, self.num_heads, self.num_kv_heads)
        if self.d_model < 4:
            raise ConfigError(f"config.d_model must be >= 4 (contrastive head is d_model//4), got {self.d_model}")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"config.activation={self.activation!r} is unknown; use one of {', '.join(ACTIVATIONS)}")
        super().check()
        if not 0.0 <= self.dropout_rate < 1.0:
            raise ConfigError(f"config.dropout_rate must be in [0, 1), got {self.dropout_rate}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ConfigError(
                f"config.pad_token_id={self.pad_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def total_layers(self) -> int:
        return self.num_encoder_layers + self.num_decoder_layers


# The published Needle v1 model (NEEDLE_V1.md, "Real size"): 26,315,421 parameters.
NEEDLE_V1_PUBLISHED = TransformerConfig(
    vocab_size=8192,
    d_model=512,
    num_heads=8,
    num_kv_heads=4,
    num_encoder_layers=12,
    num_decoder_layers=8,
)
