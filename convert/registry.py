"""The model families needle-twin knows, and how a checkpoint's family is recognised from its content.

Adding a family means adding its folders and its line here (and one in parity_tests.families).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from convert.errors import CheckpointError, ConfigError
from convert.family import AdapterFormat, Family, FileFormat
from convert.rules import markdown, pattern
from convert.v1.family import FAMILY as V1
from convert.v2 import formats as v2_formats
from convert.v2.family import FAMILY as V2
from convert.v3 import formats as v3_formats
from convert.v3 import lora as v3_lora
from convert.v3.family import FAMILY as V3

FAMILIES: dict[str, Family] = {f.name: f for f in (V1, V2, V3)}
FORMATS: dict[str, FileFormat] = {f.name: f for f in (*v3_formats.FORMATS, *v2_formats.FORMATS)}  # v3 sniffs first
ADAPTERS: dict[str, AdapterFormat] = {f.name: f for f in (*v3_lora.ADAPTERS, *v2_formats.ADAPTERS)}


def adapter_format(path) -> AdapterFormat | None:
    """The adapter format a file or directory is, from its content; None for anything else (a checkpoint)."""
    return next((f for f in ADAPTERS.values() if f.recognise(path)), None)


def family_named(name: str) -> Family:
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}; use one of {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(config: Any) -> Family:
    """The family a config object belongs to."""
    for family in FAMILIES.values():
        if type(config) is family.config_cls:
            return family
    raise ConfigError(f"{type(config).__name__} is not a Needle config; build one with "
                      f"{' or '.join(f'convert.{f.name}.TransformerConfig' for f in FAMILIES.values())}")


def detect(names: Iterable[str], layout: str, what: str) -> Family:
    """The family whose tensor names cover the most of `names` (indices ignored); an error when none fits."""
    seen = {pattern(n) for n in names}
    if not seen:
        raise CheckpointError(f"{what} holds no tensors; is it a Needle checkpoint?")
    scores = {f.name: len(seen & f.patterns(layout)) / len(seen) for f in FAMILIES.values()}
    best = max(scores, key=scores.get)
    if scores[best] < 0.5:
        raise CheckpointError(f"{what}: its tensor names match no Needle family ({', '.join(FAMILIES)}); "
                              "is it a Needle checkpoint?")
    return FAMILIES[best]


def detect_config(d: Mapping[str, Any]) -> Family | None:
    """The family whose fields a config dict names (None when it could be either)."""
    hits = {f.name: len(set(d) & set(f.config_cls.field_names())) - len(set(d) - set(f.config_cls.field_names()))
            for f in FAMILIES.values()}
    best = max(hits, key=hits.get)
    return FAMILIES[best] if list(hits.values()).count(hits[best]) == 1 else None


def mapping_markdown() -> str:
    """docs/MAPPING.md: every family's table for a config that has every rule (regenerate it with
    `python -c "from convert.registry import mapping_markdown; print(mapping_markdown(), end='')" > docs/MAPPING.md`).
    """
    return markdown((f.title, f.table(f.docs_config), f.symbols) for f in FAMILIES.values())
