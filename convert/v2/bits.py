"""Needle 2 weight bit widths (NEEDLE_V2.md §5): upstream's bits maps and which leaves the CQ quantizer touches.

A bits map is a string such as `"default=2,embedding=4,attn.q_proj=3"` (a checkpoint's
`config.weight_bits`). Its keys are canonical tensor names: the Flax path
`stack/layers/block/self_attn/q_proj/kernel` and the `.cact` record name `layer03.q_proj` both
become `attn.q_proj`, so one key covers every layer. The longest key that prefixes a tensor's
canonical name gives its width; `default` covers the rest and is required.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from convert.errors import ConfigError

TERNARY_BITS = 1.58  # three levels {-c, 0, +c}: "1.58 bits" (log2 3)
WIDTHS = (2, 3, 4, TERNARY_BITS)  # what upstream's quantizer and exporter take
DEFAULT_BITS = 4  # upstream's _WEIGHT_BITS: `needle build` without --bits and without config.weight_bits

Bits = int | float  # 2, 3, 4 or TERNARY_BITS
BitsMap = dict[str, Bits]  # canonical name prefix -> bits


def canonical_name(name: str) -> str:
    """Upstream's `canonical_tensor_name`: a Flax path or a `.cact` record name -> the bits-map key it answers to."""
    n = re.sub(r"^layer\d+\.", "attn.", name)  # .cact per-layer records
    n = re.sub(r"^engrams?_?(\d+)[./]?", r"engram\1.", n)  # engrams_0/... and engram0.... -> engram0.
    n = n.removeprefix("stack/")
    n = n.replace("layers/block/self_attn/", "attn.").replace("mtp_block/self_attn/", "mtp.")
    n = n.removesuffix("/kernel")
    if n == "embedding/embedding":
        n = "embedding"
    n = re.sub(r"^(engram\d+\.)embedding$", r"\1tables", n)
    return n.replace("/", ".")


def check_bits(bits: object, what: str = "bits") -> Bits:
    """A valid width (2, 3, 4 or 1.58) as upstream stores it (int, or TERNARY_BITS), else a ConfigError."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)):
        raise ConfigError(f"{what}={bits!r} is not a CQ width; use 2, 3, 4 or 1.58 (ternary)")
    if bits == TERNARY_BITS:
        return TERNARY_BITS
    if bits in (2, 3, 4) and float(bits).is_integer():
        return int(bits)
    raise ConfigError(f"{what}={bits!r} is not a CQ width; use 2, 3, 4 or 1.58 (ternary)")


def parse_bits_map(spec: str) -> tuple[BitsMap, Bits]:
    """Upstream's `parse_bits_map`: `"default=2,embedding=4,attn.q_proj=3"` -> ({canonical key: bits}, default).

    Keys are canonicalised (so `layer00.q_proj` and the full Flax path both mean `attn.q_proj`); a key given
    twice keeps its last width, as upstream's dict does. Widths are 2, 3, 4 or 1.58; `default` is required.
    """
    if not isinstance(spec, str):
        raise ConfigError(f"bits map {spec!r} must be a string such as 'default=4,embedding=4,attn.q_proj=3'")
    out: BitsMap = {}
    default: Bits | None = None
    for part in spec.split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise ConfigError(f"bits map {spec!r}: entry {part.strip()!r} is not KEY=BITS; write e.g. "
                              "'attn.q_proj=3'")
        bits = _parse_width(value)
        if bits is None:
            raise ConfigError(f"bits map {spec!r}: entry {part.strip()!r} has width {value!r}; use 2, 3, 4 or 1.58 "
                              "(ternary)")
        if key == "default":
            default = bits
        else:
            out[canonical_name(key)] = bits
    if default is None:
        raise ConfigError(f"bits map {spec!r} has no default; add a 'default=<bits>' entry, e.g. 'default=4,{spec}'"
                          if spec.strip() else "bits map is empty; give at least 'default=<bits>', e.g. 'default=4'")
    return out, default


def _parse_width(value: str) -> Bits | None:
    try:
        f = float(value)
    except ValueError:
        return None
    if f == TERNARY_BITS:
        return TERNARY_BITS
    try:
        i = int(value)  # upstream's int(value): "2" is a width, "2.0" is not
    except ValueError:
        return None
    return i if i in (2, 3, 4) else None


def format_bits_map(bits_map: Mapping[str, Bits], default: Bits) -> str:
    """The string `parse_bits_map` reads back to (bits_map, default); "" for upstream's plain 4-bit default."""
    if not bits_map and default == DEFAULT_BITS:
        return ""
    return ",".join([f"default={default}"] + [f"{k}={v}" for k, v in bits_map.items()])


def bits_for(name: str, bits_map: Mapping[str, Bits], default: Bits) -> Bits:
    """Upstream's `_bits_for`: the width of the longest key that prefixes `name`'s canonical name, else default."""
    canon = canonical_name(name)
    hits = [k for k in bits_map if canon.startswith(k)]
    return bits_map[max(hits, key=len)] if hits else default


def unused_keys(bits_map: Mapping[str, Bits], names: Sequence[str]) -> list[str]:
    """Keys of a bits map that prefix none of `names` (a typo such as 'atn.q_proj' silently means "default")."""
    canons = [canonical_name(n) for n in names]
    return [k for k in bits_map if not any(c.startswith(k) for c in canons)]


# ----------------------------------------------------------------------------- which leaves are quantised


def is_quant_leaf(path: str, ndim: int) -> bool:
    """Upstream's `_is_quant_leaf`: a `kernel`, `embedding` or `mhc_phi*` leaf of ndim >= 2 ("/"-joined path)."""
    key = path.rsplit("/", 1)[-1]
    return (key in ("kernel", "embedding") or key.startswith("mhc_phi")) and ndim >= 2


def groups_along_input(path: str) -> bool:
    """Upstream's `_reduces_second_last`: kernels and φ group along their input axis (second to last); embeddings
    and engram tables along their last axis."""
    key = path.rsplit("/", 1)[-1]
    return key == "kernel" or key.startswith("mhc_phi")
