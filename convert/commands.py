"""The logic behind `needle-twin convert`, `inspect` and `diff`; cli.py only parses options and prints."""

from __future__ import annotations

import contextlib
import math
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convert import io, plan, registry
from convert.errors import NeedleTwinError
from convert.fields import FamilyConfig
from convert.formats.common import load_config_json
from convert.source import Source
from convert.tensors import dtype_name
from convert.trees import flatten_tree

PROGRESS_MIN_BYTES = 32 * 2**20  # below this a conversion takes well under a second: no bar
_DIFF_BLOCK = 1 << 22  # elements compared per step; bounds the float64 temporaries to ~100 MiB


def _config_arg(config_path: Path | None) -> dict[str, Any] | None:
    return load_config_json(config_path) if config_path is not None else None


# ----------------------------------------------------------------------------- convert


@dataclass
class ConvertResult:
    src: Path
    dst: Path
    src_format: str
    dst_format: str
    num_tensors: int
    num_parameters: int
    num_bytes: int
    dtype: str
    seconds: float
    notes: list[str] = field(default_factory=list)  # e.g. what a lossy source (a .cact) could not give back


def convert(src: Path, dst: Path, *, to: str | None = None, dtype: str | None = None, force: bool = False,
            max_shard_size: str | None = None, config_path: Path | None = None, progress: bool = False,
            bits: str | None = None, tokenizer: Path | None = None, base: Path | None = None, merge: bool = False,
            allow_untrained: bool = False, layers: int | None = None, width: int | None = None) -> ConvertResult:
    """Convert SRC to DST (format from DST's form and --to); strict, atomic, interruptible without leftovers.

    bits, tokenizer: a .cact output's quantisation (2, 3, 4, 1.58 or a bits map; None: the config's weight_bits,
    else 4, as upstream's build) and its SentencePiece tokenizer record. An adapter SRC (recognised from its
    content) needs its base checkpoint: DST is then an adapter (a .pkl: upstream's; else a PEFT directory), or
    with merge the base with the adapter merged (any checkpoint format)."""
    start = time.perf_counter()
    kind = registry.adapter_format(src)
    if kind is not None:
        return _convert_adapter(kind, src, dst, base, merge, allow_untrained, force, start, to=to, dtype=dtype,
                                max_shard_size=max_shard_size, bits=bits, tokenizer=tokenizer)
    if base is not None or merge or allow_untrained:
        io.detect_format(src)  # an unreadable SRC (empty, missing) says so before being called a checkpoint
        raise NeedleTwinError(f"{src} is a checkpoint, not an adapter: --base, --merge and --allow-untrained are for "
                              "converting a LoRA adapter; drop them")
    source = io.open_source(src)
    config = io.resolve_config(source, _config_arg(config_path))
    family = registry.family_of(config)
    fmt = io.infer_write_format(dst, to, family)
    if layers is not None or width is not None:
        return _convert_submodel(src, dst, fmt, source, config, family, layers, width, start, force=force,
                                 dtype=dtype, max_shard_size=max_shard_size, bits=bits, tokenizer=tokenizer)
    total = source.nbytes if dtype is None else sum(math.prod(t.shape) for t in source.tensors.values()) * \
        io.weight_dtype(dtype).itemsize
    with _terminate_as_interrupt(), _progress_bar(total, f"{source.format} → {fmt}", progress) as on_bytes:
        io.write_source(source, config, dst, format=fmt, force=force, dtype=dtype, max_shard_size=max_shard_size,
                        on_bytes=on_bytes, bits=bits, tokenizer=tokenizer)
    dtypes = sorted({dtype_name(t.dtype) for t in source.tensors.values()}) if dtype is None else [dtype]
    owned = registry.FORMATS.get(source.format)
    notes = [f"lossy: {owned.lossy} ({source.metadata['lossy']})"] if owned is not None and owned.lossy else []
    return ConvertResult(Path(src), Path(dst), source.format, fmt, len(source.tensors),
                         sum(t.size for t in source.tensors.values()), total, ",".join(dtypes),
                         time.perf_counter() - start, notes)


def _convert_submodel(src: Path, dst: Path, fmt: str, source: Source, config: FamilyConfig, family, layers: int | None,
                      width: int | None, start: float, **options: Any) -> ConvertResult:
    """--layers / --width: a depth rung or width half of a laddered model, written as a checkpoint of its own."""
    if (layers is not None and family.rung is None) or (width is not None and family.halve is None):
        raise NeedleTwinError(f"--layers and --width apply to laddered models (Needle 3); {src} is {family.title}")
    ckpt = io.read_checkpoint(src, config)
    params, sub = ckpt.params, ckpt.config
    if width is not None:
        params, sub = family.halve(params, sub, width)
    if layers is not None:
        params, sub = family.rung(params, sub, layers)
    with _terminate_as_interrupt():
        io.write_checkpoint(params, sub, dst, format=fmt, extra=ckpt.extra, **options)
    arrays = [np.asarray(a) for a in flatten_tree(params).values()]
    cast = options["dtype"]
    nbytes = sum(a.size * (io.weight_dtype(cast).itemsize if cast else a.dtype.itemsize) for a in arrays)
    what = " ".join(filter(None, [f"rung {layers}" if layers is not None else "",
                                  f"width {width}" if width is not None else ""]))
    return ConvertResult(Path(src), Path(dst), source.format, f"{fmt} ({what})", len(arrays),
                         sum(a.size for a in arrays), nbytes,
                         cast or ",".join(sorted({dtype_name(a.dtype) for a in arrays})), time.perf_counter() - start)


def _convert_adapter(kind, src: Path, dst: Path, base: Path | None, merge: bool, allow_untrained: bool, force: bool,
                     start: float, **checkpoint_options: Any) -> ConvertResult:
    """An adapter SRC: checked against its base, written as an adapter, or merged into the base."""
    if base is None:
        raise NeedleTwinError(f"{src} is a LoRA adapter ({kind.name}); converting it needs its base checkpoint: add "
                              "--base BASE")
    if not merge and any(v is not None for v in checkpoint_options.values()):
        raise NeedleTwinError("--to, --dtype, --max-shard-size, --bits and --tokenizer apply to checkpoints: with an "
                              "adapter they need --merge (which writes the merged checkpoint)")
    adapter = kind.read(src, allow_untrained=allow_untrained)
    ckpt = io.read_checkpoint(base)
    if ckpt.family.name != kind.family:
        raise NeedleTwinError(f"{src} is a {registry.family_named(kind.family).title} adapter but --base {base} is a "
                              f"{ckpt.family.title} checkpoint; give its own base")
    kind.check(adapter, ckpt.params, ckpt.config)
    with _terminate_as_interrupt():
        if merge:
            fmt = io.infer_write_format(dst, checkpoint_options["to"])
            merged = kind.merge(adapter, ckpt.params)
            io.write_checkpoint(merged, ckpt.config, dst, format=fmt, force=force,
                                dtype=checkpoint_options["dtype"], metadata=ckpt.metadata, extra=ckpt.extra,
                                max_shard_size=checkpoint_options["max_shard_size"], bits=checkpoint_options["bits"],
                                tokenizer=checkpoint_options["tokenizer"])
            out_format = f"{fmt} (merged)"
            arrays = [np.asarray(a) for a in flatten_tree(merged).values()]  # what was written: the whole model
            cast = checkpoint_options["dtype"]
            nbytes = sum(a.size * (io.weight_dtype(cast).itemsize if cast else a.dtype.itemsize) for a in arrays)
            dtypes = [cast] if cast else sorted({dtype_name(a.dtype) for a in arrays})
            return ConvertResult(Path(src), Path(dst), kind.name, out_format, len(arrays),
                                 sum(a.size for a in arrays), nbytes, ",".join(dtypes), time.perf_counter() - start)
        else:
            kind.write(adapter, ckpt.config, dst, base=str(base), force=force)
            out_format = {".pkl": "upstream LoRA pickle", ".safetensors": "upstream LoRA safetensors"}.get(
                Path(dst).suffix, "PEFT adapter")
    params = sum(math.prod(ab[k].shape) for ab in adapter.lora.values() for k in ("A", "B"))
    return ConvertResult(Path(src), Path(dst), kind.name, out_format, 2 * len(adapter.lora), params,
                         params * 4, "float32", time.perf_counter() - start)


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the temporary output is deleted either way."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _progress_bar(total: int, label: str, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich byte-count bar on stderr for large conversions (off when disabled or stderr is not a terminal)."""
    if not enabled or total < PROGRESS_MIN_BYTES or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


# ----------------------------------------------------------------------------- inspect


def _natural(name: str) -> list[Any]:
    """Sort key that puts layers.2 before layers.10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def inspect(path: Path, config_path: Path | None = None) -> dict[str, Any]:
    """Everything a checkpoint says about itself, without converting it (tensor data is not read; a family's own
    format adds its extras, e.g. a .cact's lint and the header the engine reads; an adapter is described as one)."""
    kind = registry.adapter_format(path)
    if kind is not None:
        return {"path": str(path), "format": kind.name, "family": kind.family, "adapter": True,
                **kind.describe(kind.read(path, allow_untrained=True))}
    fmt = io.detect_format(path)
    owned = registry.FORMATS.get(fmt)
    extras = owned.describe(Path(path)) if owned is not None and owned.describe is not None else {}
    try:
        source = io.open_source(path, fmt)
    except NeedleTwinError as e:
        if not extras:
            raise
        return {"path": str(path), "format": fmt, "layout": None, "family": owned.family, "optional_groups": None,
                "config": None, "unknown_config_keys": [], "stored_config": None, "config_origin": None,
                "metadata": {}, "num_tensors": 0, "num_parameters": 0, "num_bytes": 0, "dtypes": {}, "check": str(e),
                "tensors": [], **extras}
    config, check, family, groups = None, "ok", None, None
    try:
        family = io.source_family(source)
        config = io.resolve_config(source, _config_arg(config_path))
        groups = family.groups_in(source.tensors, source.layout, config)
        plan.validate(source, family, config)
    except NeedleTwinError as e:
        check = str(e)
    refs = source.tensors
    roles = family.table(config).rule_of(source.layout) if config is not None else {}
    tensors = [{"name": name, "shape": list(refs[name].shape), "dtype": dtype_name(refs[name].dtype),
                **_role(roles.get(name), source.layout)} for name in sorted(refs, key=_natural)]
    dtypes: dict[str, int] = {}
    for t in tensors:
        dtypes[t["dtype"]] = dtypes.get(t["dtype"], 0) + 1
    return {
        "path": str(path), "format": source.format, "layout": source.layout,
        "family": family.name if family is not None else None,
        "optional_groups": None if groups is None else {g: g in groups for g in family.groups},
        "config": config.to_dict() if config is not None else None,
        "unknown_config_keys": sorted(config.extra_keys()) if config is not None else [],
        "stored_config": source.config_dict,
        "config_origin": (str(config_path) if config is not None else None) if config_path is not None
        else (source.config_origin or None),
        "metadata": dict(source.metadata),
        "num_tensors": len(tensors), "num_parameters": sum(math.prod(t["shape"]) for t in tensors),
        "num_bytes": source.nbytes, "dtypes": dtypes, "check": check, "tensors": tensors, **extras,
    }


def _role(found: tuple | None, layout: str) -> dict[str, Any]:
    """Where a tensor sits in its family's table: stacked over how many layers (a Flax array) or which layer it is
    (a torch tensor), and its optional group."""
    if found is None:
        return {}
    rule, index = found
    out: dict[str, Any] = {}
    if rule.stack is not None:
        out["layer" if layout == "torch" else "stacked"] = index if layout == "torch" else rule.stack
    if rule.group is not None:
        out["group"] = rule.group
    return out


# ----------------------------------------------------------------------------- diff


@dataclass
class TensorDiff:
    name: str
    status: str  # identical | values | bits (equal values, other bit patterns) | shape | dtype | dtype+values
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    max_abs: float | None = None  # None when shapes differ; nan when NaN positions differ
    num_different: int = 0
    layers: list[int] | None = None  # a layer-stacked array's differing layers (along its leading axis)


@dataclass
class DiffResult:
    a: Path
    b: Path
    format_a: str
    format_b: str
    config: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # field -> (a, b), only differing
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.config or self.only_a or self.only_b) and all(t.status == "identical" for t in self.tensors)

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": str(self.a), "b": str(self.b), "format_a": self.format_a, "format_b": self.format_b,
            "identical": self.identical,
            "config": {k: {"a": a, "b": b} for k, (a, b) in self.config.items()},
            "only_in_a": self.only_a, "only_in_b": self.only_b,
            "tensors": [{**t.__dict__, "shape_a": list(t.shape_a or ()), "shape_b": list(t.shape_b or ()),
                         "max_abs": _json_float(t.max_abs)} for t in self.tensors],
        }


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return str(x)


@dataclass
class _DiffSide:
    source: Source
    config: FamilyConfig
    view: list[plan.Planned]  # whole Flax tensors present
    partial: dict[str, list[plan.Planned]]  # stacks with layers missing: their present layers
    unknown: list[plan.Planned]  # tensors the config does not know, as stored

    @classmethod
    def open(cls, path: Path, config_path: Path | None) -> _DiffSide:
        source = io.open_source(path)
        config = io.resolve_config(source, _config_arg(config_path))
        return cls(source, config, *plan.present_flax_view(source, registry.family_of(config), config))

    def stacked(self) -> set[str]:
        """The Flax names of this side's whole layer-stacked arrays."""
        table = registry.family_of(self.config).table(self.config)
        return {r.flax for r in table.rules if r.stack is not None}

    def by_name(self, split: set[str]) -> dict[str, plan.Planned]:
        """Every tensor by its compared name: the stacks in `split` layer by layer ("name[i]")."""
        whole = [q for p in self.view for q in (plan.layers(p) if p.name in split else [p])]
        return {p.name: p for p in whole + [q for qs in self.partial.values() for q in qs] + self.unknown}


def diff(a: Path, b: Path, config_a: Path | None = None, config_b: Path | None = None) -> DiffResult:
    """Key-level and value-level differences of two checkpoints in any formats, compared in the Flax layout.

    A tensor missing from one side is a key only the other has; a stacked array with layers missing on a side
    is compared layer by layer ("name[i]") on both, so the layers there are still compared."""
    side_a, side_b = _DiffSide.open(a, config_a), _DiffSide.open(b, config_b)
    result = DiffResult(Path(a), Path(b), side_a.source.format, side_b.source.format)
    result.config = side_a.config.differences(side_b.config)
    split = set(side_a.partial) | set(side_b.partial)
    by_a, by_b = side_a.by_name(split), side_b.by_name(split)
    result.only_a = sorted(set(by_a) - set(by_b), key=_natural)
    result.only_b = sorted(set(by_b) - set(by_a), key=_natural)
    stacked = side_a.stacked() | side_b.stacked()
    for name in sorted(set(by_a) & set(by_b), key=_natural):
        result.tensors.append(compare(name, by_a[name], by_b[name], stacked=name in stacked))
    return result


def compare(name: str, pa: plan.Planned, pb: plan.Planned, stacked: bool = False) -> TensorDiff:
    """Bitwise identity, else the max |a - b| (in float64), how many elements differ and (stacked: a layer-stacked
    array) in which layers."""
    d = TensorDiff(name, "identical", pa.shape, pb.shape, dtype_name(pa.dtype), dtype_name(pb.dtype))
    if pa.shape != pb.shape:
        d.status = "shape"
        return d
    x, y = pa.array().reshape(-1), pb.array().reshape(-1)
    if pa.dtype == pb.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8)):
        d.max_abs = 0.0
        return d
    worst, count, nan_mismatch = 0.0, 0, False
    per_layer = max(1, x.size // pa.shape[0]) if stacked and pa.shape else 0
    changed: set[int] = set()
    for start in range(0, x.size, _DIFF_BLOCK):
        u = x[start:start + _DIFF_BLOCK].astype(np.float64)
        v = y[start:start + _DIFF_BLOCK].astype(np.float64)
        same = (u == v) | (np.isnan(u) & np.isnan(v))
        count += int(np.count_nonzero(~same))
        if per_layer:
            changed.update(((start + np.flatnonzero(~same)) // per_layer).tolist())
        nan_mismatch |= bool(np.any(np.isnan(u) ^ np.isnan(v)))
        delta = np.abs(u - v)[~same & ~np.isnan(u) & ~np.isnan(v)]
        if delta.size:
            worst = max(worst, float(delta.max()))
    d.max_abs = math.nan if nan_mismatch else worst
    d.num_different = count
    d.layers = sorted(changed) if per_layer else None
    if pa.dtype != pb.dtype:
        d.status = "dtype+values" if count else "dtype"
    else:
        d.status = "values" if count else "bits"  # equal values, different bits: -0.0 vs 0.0 or NaN payloads
    return d
