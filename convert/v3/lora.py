"""Needle 3 LoRA adapters (`needle finetune`, NEEDLE_V3.md §7.2): upstream's safetensors adapter, and PEFT's.

Upstream's file (`checkpoints.write_adapter`) is a safetensors file: tensors `lora/<flax path>/A` (L, in, r) and
`lora/<flax path>/B` (L, r, out), an optional `rows` (a Whistle adapter's new vocabulary rows), and metadata
`scale`, `base`, `rank`, `seed`, `pieces`, `languages`, each JSON-encoded (`base` keeps its quotes; 3.0.0 adapters
lack `pieces` and `languages`, read as None, as upstream's `read_adapter` does). Metadata is parsed as JSON data,
never evaluated; tensors are read from the checked header one at a time.

The targets, their torch modules, PEFT's layout and upstream's merge rule `W + cast_{W.dtype}(scale·(A@B))` are
Needle 2's (the five `stack/layers/block/self_attn/*/kernel` paths and `stack.layers.{i}.block.self_attn.*`
modules are the same in both families; tests/v3/test_lora.py holds that against the v3 mapping), so this module
reuses convert.v2.lora for them and adds what is Needle 3's own: the file, its metadata and the v3 shapes.
A PEFT directory written here carries upstream's metadata in adapter_model.safetensors' own metadata (PEFT
ignores it), so adapter -> PEFT -> adapter gives back the same metadata.

Shapes: L layers, in/out the kernel's (in, out) widths, r rank.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convert.atomic import atomic_output
from convert.errors import CheckpointError
from convert.family import AdapterFormat
from convert.formats import safetensors_format
from convert.plan import Planned
from convert.tensors import dtype_name, is_finite
from convert.trees import flatten_tree
from convert.v2 import lora as v2
from convert.v3.config import TransformerConfig
from convert.v3.mapping import block, dims

LORA_TARGETS = v2.LORA_TARGETS  # upstream's lora_target_paths on a Needle 3 tree: the same five kernels
_RULES = {r.flax: r for r in block(TransformerConfig()) if r.flax in LORA_TARGETS}
FIELDS = ("scale", "base", "rank", "seed", "pieces", "languages")  # upstream's _ADAPTER_FIELDS, in its order
PREFIX, ROWS = "lora/", "rows"
PEFT_CONFIG, PEFT_WEIGHTS = v2.PEFT_CONFIG, v2.PEFT_WEIGHTS
PEFT_METADATA_KEY = "needle3_adapter"  # adapter_model.safetensors metadata: upstream's metadata strings, as JSON
SUFFIX = ".safetensors"  # upstream refuses any other adapter name ("for security")
_FLOAT_CODES = ("float16", "bfloat16", "float32", "float64")
_HEAD_SNIFF = 1 << 16  # bytes of header read to recognise an adapter (its tensor names come first)


@dataclass(frozen=True)
class Adapter:
    """One Needle 3 adapter in upstream's terms: `lora` maps each flax path to {"A": (L, in, r), "B": (L, r, out)},
    as `merge_lora` takes it. `languages` non-null marks a Whistle adapter (`rows`, `pieces` are its vocabulary),
    which upstream's `needle build` refuses and so do the merge and PEFT paths here. `extra`: metadata keys upstream
    does not know, kept verbatim. `native`: base and seed are upstream's own (its file, or our PEFT copy of it)."""

    lora: dict[str, dict[str, np.ndarray]]
    scale: float
    rank: int
    base: str | None = None
    seed: int | None = None
    pieces: list[str] | None = None
    languages: list[str] | None = None
    rows: np.ndarray | None = None
    extra: dict[str, str] = field(default_factory=dict)
    native: bool = field(default=True, compare=False)
    raw: dict[str, str] = field(default_factory=dict, compare=False)  # the metadata strings as read

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.lora)

    @property
    def num_layers(self) -> int | None:
        """L of the stacked (L, in, r) A matrices; None when the first target is an unstacked (Whistle) one."""
        a = next(iter(self.lora.values()))["A"]
        return a.shape[0] if a.ndim == 3 else None

    @property
    def alpha(self) -> float:
        """PEFT's lora_alpha: alpha / rank gives back exactly this scale (convert.v2.lora.peft_alpha)."""
        return v2.peft_alpha(self.scale, self.rank)

    @property
    def whistle(self) -> bool:
        return self.languages is not None

    def metadata(self) -> dict[str, str]:
        """The file's metadata strings, as upstream's `json.dumps(adapter.get(key), default=str)` writes them; a
        string read from a file is kept verbatim while its value is unchanged."""
        values = {"scale": float(self.scale), "base": self.base, "rank": int(self.rank),
                  "seed": None if self.seed is None else int(self.seed), "pieces": self.pieces,
                  "languages": self.languages}
        out = {}
        for k in FIELDS:
            raw = self.raw.get(k)
            kept = raw is not None and _metadata_value("", self.raw, k) == values[k]
            out[k] = raw if kept else json.dumps(values[k], default=str)
        return {**out, **self.extra}


# ----------------------------------------------------------------------------- checks


def _is_int(x: Any) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check(adapter: Adapter, what: str, allow_untrained: bool = False) -> Adapter:
    """The adapter on its own: metadata types, then (as for Needle 2) targets, shapes, rank, finite values, B not
    all zero. A Whistle adapter's targets are Whistle's, so only their shapes and values are checked."""
    for name in ("base", "seed", "pieces", "languages"):
        value = getattr(adapter, name)
        ok = value is None or {"base": lambda v: isinstance(v, str), "seed": _is_int,
                               "pieces": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                               "languages": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                               }[name](value)
        if not ok:
            want = {"base": "the base checkpoint's path", "seed": "an integer", "pieces": "a list of strings",
                    "languages": "a list of language codes"}[name]
            raise CheckpointError(f"{what}: '{name}' is {json.dumps(value, default=str)[:60]}; expected null or "
                                  f"{want}")
    if adapter.rows is not None:
        rows = adapter.rows
        if rows.ndim != 2 or dtype_name(rows.dtype) not in _FLOAT_CODES:
            raise CheckpointError(f"{what}: 'rows' is {dtype_name(rows.dtype)}{list(rows.shape)}; expected a 2-D "
                                  "float array (a Whistle adapter's vocabulary rows)")
        if not is_finite(rows):
            raise CheckpointError(f"{what}: 'rows' holds NaN or Inf values; the adapter is corrupt (a diverged run?), "
                                  "use another checkpoint of it")
    if not adapter.whistle:
        v2.check_alone(as_v2(adapter), what, allow_untrained)
        return adapter
    for target, ab in adapter.lora.items():  # Whistle: its own targets
        if sorted(ab) != ["A", "B"]:
            raise CheckpointError(f"{what}: {target} must hold exactly the arrays 'A' and 'B', got {sorted(ab)}")
        a, b = ab["A"], ab["B"]
        if a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2] or a.shape[-1] != b.shape[-2]:
            raise CheckpointError(f"{what}: {target} A {list(a.shape)} and B {list(b.shape)} do not chain; expected "
                                  "A ([L,] in, r) and B ([L,] r, out)")
        for x, arr in ab.items():
            if not is_finite(arr):
                raise CheckpointError(f"{what}: {target} {x} holds NaN or Inf values; the adapter is corrupt")
    return adapter


def as_v2(adapter: Adapter) -> v2.Adapter:
    """The same adapter in Needle 2's terms (its checks and PEFT layout apply unchanged)."""
    return v2.Adapter(adapter.lora, adapter.scale, adapter.rank, adapter.base or "")


def _refuse_whistle(adapter: Adapter, what: str) -> None:
    if adapter.whistle or adapter.rows is not None:
        kind = f"this is a Whistle adapter (languages {adapter.languages})" if adapter.whistle else \
            "this adapter has vocabulary 'rows' (Whistle's)"
        raise CheckpointError(f"{what}: {kind}, not a Needle 3 one; its targets and rows belong to Whistle's model, "
                              "so it neither merges into a Needle 3 base nor loads into the Needle 3 twin: build it "
                              "with upstream's `needle whistle build`")


def _expected(target: str, config: TransformerConfig) -> tuple[int, int, int]:
    """(L, in, out) of a target's kernel in a model of this config."""
    d = dims(config)
    return (config.num_layers, *(d[s] for s in _RULES[target].shape))


def _check_config(adapter: Adapter, config: TransformerConfig, what: str, base: str | None = None) -> None:
    """The adapter fits a Needle 3 model of this config (layer count, widths); a mismatch names both bases."""
    ours = f"its 'base' is {adapter.base!r}" + (f", --base is {base!r}" if base else "")
    if adapter.num_layers != config.num_layers:
        raise CheckpointError(
            f"{what}: the adapter is for another base: it has {adapter.num_layers} layers, the base has "
            f"{config.num_layers} (num_layers; a ladder rung's adapter needs that rung as its base); {ours}")
    for target, ab in adapter.lora.items():
        want = _expected(target, config)
        got = v2.delta_shape(ab)
        if got != want:
            hq, hv = config.head_dims
            raise CheckpointError(
                f"{what}: adapter/base shape mismatch at {target}: the adapter's A @ B is {list(got)}, the base's "
                f"kernel is {list(want)} (d_model {config.d_model}, heads {config.num_heads}/{config.num_kv_heads}, "
                f"head dims {hq}/{hv}); the adapter is for another base ({ours})")


def check_adapter(adapter: Adapter, params: Mapping[str, Any], config: TransformerConfig,
                  what: str = "LoRA adapter", base: str | None = None) -> None:
    """Everything that makes upstream's `needle build --lora` go wrong with this base: a Whistle adapter, another
    base's shapes, targets on all-zero kernels, a merge that overflows a float16 base (upstream issue #53)."""
    _refuse_whistle(adapter, what)
    _check(adapter, what, allow_untrained=True)
    _check_config(adapter, config, what, base)
    flat = flatten_tree(params)
    for target in adapter.lora:
        w = flat.get(target)
        if w is not None and float(np.max(np.abs(np.asarray(w, np.float32)))) <= v2.ZERO_BASE:
            raise CheckpointError(
                f"{what}: {target} targets an all-zero base kernel (max|W| <= {v2.ZERO_BASE:g}); upstream's "
                "lora_target_paths keeps only kernels with max|W| > 1e-6, so this adapter was not trained on this "
                f"base (its 'base' is {adapter.base!r}); pass the right base")
    merged_params(adapter, params, what)


# ----------------------------------------------------------------------------- merge


def merged_params(adapter: Adapter, params: Mapping[str, Any], what: str = "LoRA adapter") -> dict[str, Any]:
    """The base tree with the adapter merged by upstream's rule: A and B widened to float32 (an fp16/bf16 adapter's
    product never overflows there), scale·(A@B) cast once to W's dtype and added in W's dtype, as `needle build`
    does; a merge that still overflows W's dtype is refused naming the target."""
    _refuse_whistle(adapter, what)
    return v2.merged_params(adapter, params, what)


# ----------------------------------------------------------------------------- upstream's safetensors adapter


def _sniff(path: Path) -> bytes:
    """The start of a file's safetensors header JSON (b"" when it has none)."""
    with open(path, "rb") as f:
        head = f.read(8 + _HEAD_SNIFF)
    if len(head) < 9:
        return b""
    (n,) = struct.unpack_from("<Q", head)
    return head[8:8 + min(n, _HEAD_SNIFF)]


def is_upstream_adapter(path: Path) -> bool:
    """Upstream's adapter file: a safetensors header naming `lora/...` tensors (even when the file is cut short,
    so that a truncated adapter is named as one)."""
    try:
        text = _sniff(Path(path))
    except OSError:
        return False
    return text.startswith(b"{") and b'"' + PREFIX.encode() in text


def _metadata_value(path: str, metadata: Mapping[str, str], key: str) -> Any:
    """Upstream's `_json_or_default(metadata.get(key), None)`: absent or "" is None, anything else JSON data."""
    raw = metadata.get(key)
    if raw in (None, ""):
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}: the {key!r} metadata {raw[:40]!r} is not JSON (upstream JSON-encodes every "
                              "adapter field, e.g. scale \"2.0\", base \"\\\"needle3.safetensors\\\"\"); the file is "
                              "damaged or not upstream's adapter") from None


def read_upstream_adapter(path: str | Path, *, allow_untrained: bool = False) -> Adapter:
    """Read upstream's safetensors adapter: header and metadata checked first, then each tensor (see `_check`)."""
    path = Path(path)
    what = str(path)
    if not path.is_file():
        raise CheckpointError(f"{what}: no such adapter file (upstream's adapter is one {SUFFIX} file; a PEFT "
                              "adapter is a directory)")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{what}: empty file (0 bytes); not an adapter, re-copy it")
    refs, metadata, _ = safetensors_format.read_header(path)
    if not any(name.startswith(PREFIX) for name in refs):
        if "config" in metadata or "format_version" in metadata:
            raise CheckpointError(f"{what}: this is a model checkpoint, not a LoRA adapter; pass the adapter file "
                                  "`needle finetune` wrote")
        raise CheckpointError(f"{what}: no lora/<path>/A|B tensors; not upstream's LoRA adapter")
    values = {key: _metadata_value(what, metadata, key) for key in FIELDS}
    missing = [k for k in ("scale", "rank") if values[k] is None]
    if missing:
        raise CheckpointError(f"{what}: the metadata has no {' or '.join(map(repr, missing))} (it has "
                              f"{sorted(metadata)}); upstream's adapter records scale and rank, re-export it")
    shapes = {}
    for name, ref in refs.items():
        if name == ROWS:
            continue
        target, _, which = name[len(PREFIX):].rpartition("/")
        if not name.startswith(PREFIX) or which not in ("A", "B") or not target:
            raise CheckpointError(f"{what}: tensor {name!r} is neither lora/<param path>/A|B nor rows; not "
                                  "upstream's adapter layout")
        if dtype_name(ref.dtype) not in _FLOAT_CODES or len(ref.shape) not in (2, 3):  # 2-D: Whistle's unscanned
            raise CheckpointError(f"{what}: {target} {which} is {dtype_name(ref.dtype)}{list(ref.shape)}; expected "
                                  f"a 3-D float array ({'(L, in, r)' if which == 'A' else '(L, r, out)'})")
        shapes.setdefault(target, {})[which] = ref
    lora = {t: {x: ref.load() for x, ref in sorted(ab.items())} for t, ab in shapes.items()}
    rows = refs[ROWS].load() if ROWS in refs else None
    scale, rank = values["scale"], values["rank"]
    if isinstance(scale, int) and not isinstance(scale, bool):
        scale = float(scale)
    extra = {k: v for k, v in metadata.items() if k not in FIELDS}
    raw = {k: metadata[k] for k in FIELDS if k in metadata}
    adapter = Adapter(lora, scale, rank, values["base"], values["seed"], values["pieces"], values["languages"], rows,
                      extra, raw=raw)
    return _check(adapter, what, allow_untrained)


def write_upstream_adapter(adapter: Adapter, dst: str | Path, *, base: str | None = None,
                           force: bool = False) -> Path:
    """Write upstream's adapter file, as its `write_adapter` does (float32 tensors in name order, the six metadata
    strings; upstream's safetensors.numpy reads no bfloat16). Atomic; never over dst without force.

    base: the base checkpoint path to record (default: the adapter's own)."""
    dst = Path(dst)
    what = str(dst)
    if not dst.name.endswith(SUFFIX):
        raise CheckpointError(f"{what}: upstream's adapter must be a {SUFFIX} file (its read_adapter refuses any "
                              f"other name); name it {dst.stem}{SUFFIX}, or give a directory name for PEFT")
    _check(adapter, what, allow_untrained=True)
    if base is not None:
        adapter = dataclasses.replace(adapter, base=base)
    tensors = {f"{PREFIX}{t}/{x}": ab[x] for t, ab in adapter.lora.items() for x in "AB"}
    if adapter.rows is not None:
        tensors[ROWS] = adapter.rows
    planned = [Planned.of(name, np.ascontiguousarray(tensors[name], np.float32)) for name in sorted(tensors)]
    with atomic_output(dst, force=force) as tmp:
        safetensors_format.write_file(tmp, planned, adapter.metadata())
    return dst


# ----------------------------------------------------------------------------- PEFT adapter directories


def write_peft(adapter: Adapter, config: TransformerConfig, dst: str | Path, *, base_name: str | None = None,
               force: bool = False) -> Path:
    """Write a PEFT adapter directory that `peft.PeftModel.from_pretrained(needle_torch.v3 model, dst)` loads onto
    exactly the main stack's attention projections (Needle 2's layout: convert.v2.lora.write_peft). Upstream's
    metadata travels in adapter_model.safetensors' metadata. Atomic; never over dst without force.

    base_name: base_model_name_or_path to record (default: the adapter's 'base'; upstream's stays in the metadata)."""
    dst = Path(dst)
    what = str(dst)
    _refuse_whistle(adapter, what)
    _check(adapter, what, allow_untrained=True)
    _check_config(adapter, config, what, base_name)
    tensors = [Planned.of(name, array) for name, array in v2.peft_tensors(adapter).items()]
    text = json.dumps(v2.peft_config(adapter, base_name), indent=2, sort_keys=True) + "\n"  # PEFT's own layout
    metadata = {"format": "pt", PEFT_METADATA_KEY: json.dumps(adapter.metadata(), sort_keys=True)}
    with atomic_output(dst, force=force, directory=True) as tmp:
        tmp.mkdir()
        safetensors_format.write_file(tmp / PEFT_WEIGHTS, tensors, metadata)
        (tmp / PEFT_CONFIG).write_text(text, encoding="utf-8")
    return dst


def _peft_metadata(path: Path) -> dict[str, str] | None:
    """Upstream's metadata strings a PEFT directory of ours carries; None for PEFT's own (a torch-trained one)."""
    _, metadata, _ = safetensors_format.read_header(path / PEFT_WEIGHTS)
    if PEFT_METADATA_KEY not in metadata:
        return None
    try:
        stored = json.loads(metadata[PEFT_METADATA_KEY])
    except json.JSONDecodeError:
        stored = None
    if not isinstance(stored, dict) or not all(isinstance(v, str) for v in stored.values()):
        raise CheckpointError(f"{path / PEFT_WEIGHTS}: its {PEFT_METADATA_KEY!r} metadata is not a JSON object of "
                              "strings; the file is damaged, re-convert the adapter")
    return stored


def read_peft(path: str | Path, *, allow_untrained: bool = False, num_layers: int | None = None) -> Adapter:
    """Read a PEFT LoRA adapter directory of the needle_torch.v3 twin as upstream's adapter (refusing what upstream's
    merge cannot express, as convert.v2.lora.read_peft). Scale and rank come from adapter_config.json; base, seed,
    pieces and languages from upstream's metadata when we wrote the directory (else base_model_name_or_path)."""
    path = Path(path)
    what = str(path)
    plain = v2.read_peft(path, allow_untrained=allow_untrained, num_layers=num_layers)
    stored = _peft_metadata(path)
    if stored is None:
        return _check(Adapter(plain.lora, plain.scale, plain.rank, plain.base or None, native=False), what,
                      allow_untrained)
    values = {key: _metadata_value(what, stored, key) for key in ("base", "seed", "pieces", "languages")}
    extra = {k: v for k, v in stored.items() if k not in FIELDS}
    raw = {k: v for k, v in stored.items() if k in FIELDS}
    return _check(Adapter(plain.lora, plain.scale, plain.rank, **values, extra=extra, raw=raw), what, allow_untrained)


# ----------------------------------------------------------------------------- for the CLI


def is_adapter(path: Path) -> bool:
    """Upstream's adapter file, or a PEFT directory of a Needle 3 adapter: ours (its metadata says so), or PEFT's
    own when its shapes are Needle 3's (k_proj and v_proj of different widths: qk and v head dims differ).
    A PEFT directory that could be either is left to Needle 2's reader, which claims every PEFT directory."""
    path = Path(path)
    if not path.is_dir():
        return path.is_file() and is_upstream_adapter(path)
    weights = path / PEFT_WEIGHTS
    if not ((path / PEFT_CONFIG).is_file() and weights.is_file()):
        return False
    try:
        refs, metadata, _ = safetensors_format.read_header(weights)
    except (OSError, CheckpointError):
        return False  # Needle 2's reader names what is wrong with it
    if PEFT_METADATA_KEY in metadata:
        return True
    if v2.PEFT_LATE_KEY in metadata:
        return False
    k, v = (refs.get(v2.peft_key(f"stack/layers/block/self_attn/{p}/kernel", 0, "B")) for p in ("k_proj", "v_proj"))
    return k is not None and v is not None and k.shape[0] != v.shape[0]


def read_adapter(path: str | Path, *, allow_untrained: bool = False) -> Adapter:
    """An adapter from upstream's safetensors file or a PEFT adapter directory."""
    reader = read_peft if Path(path).is_dir() else read_upstream_adapter
    return reader(path, allow_untrained=allow_untrained)


def write_adapter(adapter: Adapter, config: TransformerConfig, dst: str | Path, *, base: str | None = None,
                  force: bool = False) -> Path:
    """dst ending in .safetensors: upstream's adapter file; anything else: a PEFT adapter directory.

    base (the CLI's --base): recorded as PEFT's base_model_name_or_path, and as upstream's `base` when the adapter
    has no upstream base of its own (a torch-trained one); upstream's own base is kept verbatim."""
    if Path(dst).name.endswith(SUFFIX):
        _refuse_whistle(adapter, str(dst))
        _check_config(adapter, config, str(dst), base)
        keep = adapter.native and adapter.base is not None
        return write_upstream_adapter(adapter, dst, base=None if keep else base, force=force)
    return write_peft(adapter, config, dst, base_name=base, force=force)


def describe(adapter: Adapter) -> dict[str, Any]:
    """What `inspect` shows: Needle 2's fields plus seed, pieces, languages and rows; a Whistle adapter is named."""
    out = {
        "format": "Needle 3 LoRA adapter" if not adapter.whistle else "Whistle LoRA adapter (Needle 3 package)",
        "base": adapter.base,
        "layers": adapter.num_layers,
        "rank": adapter.rank,
        "scale": adapter.scale,
        "lora_alpha": adapter.alpha,
        "seed": adapter.seed,
        "pieces": None if adapter.pieces is None else len(adapter.pieces),
        "languages": adapter.languages,
        "rows": None if adapter.rows is None else list(adapter.rows.shape),
        "whistle": adapter.whistle,
        "targets": {t: {"A": list(ab["A"].shape), "B": list(ab["B"].shape), "dtype": dtype_name(ab["A"].dtype)}
                    for t, ab in adapter.lora.items()},
        "untrained_targets": [t for t, ab in adapter.lora.items() if not np.any(ab["B"])],
        "extra_metadata": dict(adapter.extra),
    }
    if adapter.whistle:
        out["note"] = (f"Whistle adapter (languages {', '.join(adapter.languages)}): upstream's `needle build` refuses "
                       "it; build it with `needle whistle build`")
    return out


ADAPTER = AdapterFormat(
    name="needle3-lora", family="v3", recognise=is_adapter, read=read_adapter, describe=describe,
    check=check_adapter, merge=merged_params, write=write_adapter,
)
ADAPTERS = (ADAPTER,)


__all__ = [
    "ADAPTER", "ADAPTERS", "FIELDS", "LORA_TARGETS", "Adapter", "check_adapter", "describe", "is_adapter",
    "is_upstream_adapter", "merged_params", "read_adapter", "read_peft", "read_upstream_adapter", "write_adapter",
    "write_peft", "write_upstream_adapter",
]
