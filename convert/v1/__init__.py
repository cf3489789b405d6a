"""Needle v1 (the 26M encoder-decoder): its config and mapping rules, declared as a family."""

from convert.family import Family
from convert.v1 import mapping
from convert.v1.config import NEEDLE_V1_PUBLISHED, TransformerConfig

FAMILY = Family(
    name="v1",
    title="Needle v1 (encoder-decoder)",
    config_cls=TransformerConfig,
    rules=mapping.rules,
    dims=mapping.dims,
    stack_names=mapping.STACKS,
    symbols=mapping.SYMBOLS,
    published=NEEDLE_V1_PUBLISHED,
    docs_config=TransformerConfig(no_feedforward=False),
    hint=mapping.config_hint,
)

__all__ = ["FAMILY", "NEEDLE_V1_PUBLISHED", "TransformerConfig"]
