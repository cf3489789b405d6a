"""Needle v1 (the 26M encoder-decoder): its config and mapping rules, declared as a family."""

from convert.v1.config import NEEDLE_V1_PUBLISHED, TransformerConfig
from convert.v1.family import FAMILY

__all__ = ["FAMILY", "NEEDLE_V1_PUBLISHED", "TransformerConfig"]
