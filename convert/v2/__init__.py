"""Needle 2 (the 45M decoder-only model): its config, mapping rules and files, declared as a family."""

from convert.v2.config import NEEDLE_V2_PUBLISHED, PRESETS, TransformerConfig
from convert.v2.family import FAMILY

__all__ = ["FAMILY", "NEEDLE_V2_PUBLISHED", "PRESETS", "TransformerConfig"]
