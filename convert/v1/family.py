"""The Needle v1 family declaration: what shared code knows of it."""

from __future__ import annotations

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
