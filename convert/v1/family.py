"""The Needle v1 family declaration: what shared code knows of it."""

from __future__ import annotations

from convert.family import CliOption, Family
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
    parity_options=(
        CliOption("src_len", int, "encoder length of the random batch", default=64),
        CliOption("tgt_len", int, "decoder length of the random batch, or of a generated tgt", default=32),
    ),
    generate_options=(
        CliOption("suppress", str, "token ids never to choose, e.g. '0 2 3'"),
        CliOption("max_enc_len", int, "truncate --query/--tools to this many encoder tokens, as upstream does",
                  min=2),
    ),
)
