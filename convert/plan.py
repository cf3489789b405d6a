"""The one mapping engine: strict checks of a checkpoint against its family's rules, and lazy views in either layout.

Every layout change goes through the family's rule table (convert.rules): a view only renames,
transposes and (un)stacks, so data passes through bit-exact unless a dtype cast is asked for.
The same views serve in-memory trees (convert.mapping) and files read lazily (convert.io).
Views describe each output tensor by the source pieces it is made of (a layer of a stacked
array is read on its own); writers produce the output part by part (convert.sink), so the
whole checkpoint is never in memory when the source is read lazily.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial

import numpy as np

from convert.errors import CheckpointError
from convert.family import Family
from convert.rules import FLAX, TORCH, ParamTable, entry_problems
from convert.source import Source
from convert.tensors import WEIGHT_DTYPES, TensorRef, dtype_name, map_span

EMBEDDING = {FLAX: "embedding/embedding", TORCH: "embedding.weight"}
PART_BYTES = 8 * 2**20  # largest band of rows a writer makes at once
# A transpose's band of output rows reads a band of source columns (strided rows): on the benchmark, 4 MiB
# bands of its 2048x2048 float16 pieces cost 2.2-2.8 CPU-s against 1.7-2.1 whole. So pieces are transposed
# whole up to this size (32 MiB: 4096x4096 float16).
TRANSPOSE_PART_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Piece:
    """One source array of an output tensor: a whole TensorRef or layer `index` of a stacked one."""

    ref: TensorRef
    index: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.ref.shape if self.index is None else self.ref.shape[1:]

    def load(self) -> np.ndarray:
        """The piece as an array of its own (from a file, only this layer's bytes are read)."""
        if self.ref.span is not None:
            return np.array(self.read())  # a copy of its own: the mapping goes with the view
        array = self.ref.load()
        return array if self.index is None else array[self.index, ...]  # [i, ...] keeps a 0-d gate an array

    def read(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The piece (rows start:stop of it): mapped read-only from its file when its bytes lie in one,
        else the in-memory array (a view either way, maybe not C-contiguous in memory)."""
        if self.ref.span is None:
            return self.load() if stop is None else self.load()[start:stop]
        path, offset = self.ref.span
        shape, itemsize = self.shape, self.ref.dtype.itemsize
        band = shape if stop is None else (stop - start, *shape[1:])
        at = offset + (self.index or 0) * math.prod(shape) * itemsize + start * math.prod(shape[1:]) * itemsize
        return map_span(path, at, band, self.ref.dtype)


@dataclass(frozen=True)
class Planned:
    """One output tensor: name in the target layout, shape, dtype, and the source pieces it is made of.

    With `stacked`, piece i becomes out[i] (layers stacked on a new leading axis); otherwise the single
    piece is the whole tensor. `transpose` flips each piece's two axes (Dense kernel (in, out) <-> Linear
    weight (out, in)). Nothing is read until a part is made (`jobs`), `fill` or `array`.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: tuple[Piece, ...]
    stacked: bool = False
    transpose: bool = False

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> Planned:
        """An in-memory array, as is."""
        return cls(name, tuple(array.shape), array.dtype, (Piece(TensorRef.of(array)),))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def fill(self, out: np.ndarray) -> None:
        """Write the tensor into `out` (self.shape, self.dtype), copying from the (mapped) pieces once."""
        if self.stacked:
            for i, piece in enumerate(self.pieces):
                copy_into(out[i, ...], piece.read(), self.transpose)
        else:
            copy_into(out, self.pieces[0].read(), self.transpose)

    def jobs(self) -> Iterator[tuple[int, Callable[[np.ndarray, Callable[[int], np.ndarray]], np.ndarray]]]:
        """(nbytes, make) per part of the tensor, in file order; make(dest, scratch) writes the part into dest
        (nbytes of uint8) and returns it there as an array of self.dtype.

        A part is a piece (a layer) or, past PART_BYTES (TRANSPOSE_PART_BYTES when transposed), a band of as
        many rows as fit in that (at least one): an embedding is 100+ MB, bands keep the writer's buffers small
        and let it start early. Parts are independent, so writers may make several at once. scratch(nbytes)
        lends a transpose its working block (a reusable uint8 buffer).
        """
        shape = self.shape[1:] if self.stacked else self.shape
        nbytes = math.prod(shape) * self.dtype.itemsize
        limit = TRANSPOSE_PART_BYTES if self.transpose else PART_BYTES
        bands: list[tuple[int, int | None]] = [(0, None)]
        if nbytes > limit:  # so shape has rows, each of >= 1 byte
            rows = max(1, limit // (nbytes // shape[0]))
            bands = [(r, min(r + rows, shape[0])) for r in range(0, shape[0], rows)]
        for piece in self.pieces:
            for start, stop in bands:
                band = shape if stop is None else (stop - start, *shape[1:])
                yield math.prod(band) * self.dtype.itemsize, partial(self._make_part, piece, start, stop, band)

    def _make_part(self, piece: Piece, start: int, stop: int | None, band: tuple[int, ...], dest: np.ndarray,
                   scratch: Callable[[int], np.ndarray]) -> np.ndarray:
        out = dest.view(self.dtype).reshape(band)
        if self.transpose:  # rows start:stop of source.T are its last axis' start:stop
            source = piece.read() if stop is None else piece.read()[..., start:stop]
        else:
            source = piece.read(start, stop)
        copy_into(out, source, self.transpose, scratch)
        return out

    def array(self) -> np.ndarray:
        """The tensor as a C-contiguous array of its own (or the in-memory source, when nothing changes)."""
        if self.stacked or self.transpose or self.pieces[0].ref.span is not None:
            out = np.empty(self.shape, self.dtype)
            self.fill(out)  # from the mapped file once, straight into out
            return out
        source = self.pieces[0].load()  # in memory (or read by its own reader): once
        if source.dtype == self.dtype and source.flags.c_contiguous and source.shape == self.shape:
            return source
        out = np.empty(self.shape, self.dtype)
        copy_into(out, source)  # a cast
        return out


# ----------------------------------------------------------------------------- checks


def table_for(source: Source, family: Family, config) -> ParamTable:
    """The rules this checkpoint should match: the family's required ones plus the optional groups it holds."""
    return family.table_for(source.tensors, source.layout, config)


def validate(source: Source, family: Family, config, cast: np.dtype | None = None) -> ParamTable:
    """One CheckpointError listing every missing, unexpected, mis-shaped and wrong-dtype tensor; returns the table."""
    table = table_for(source, family, config)
    found = {name: ref.shape for name, ref in source.tensors.items()}
    problems = _layer_count_problems(source, table) + entry_problems(found, table.expected(source.layout))
    hint = _config_hint(source, family, config) if problems else ""  # a dtype problem is not the config's fault
    problems += _dtype_problems(source.tensors, _anchor(table, source.layout), lenient=cast is not None)
    problems += _stack_dtype_problems(source, table, cast)
    if problems:
        raise CheckpointError(f"{source.path} does not match its config: " + "; ".join(problems)
                              + (f". {hint}" if hint else ""))
    return table


def check_names(source: Source, family: Family, config, what: str) -> ParamTable:
    """Names and shapes only (an in-memory tree or state_dict of any dtypes), plus one dtype per stacked array."""
    table = table_for(source, family, config)
    problems = entry_problems({n: r.shape for n, r in source.tensors.items()}, table.expected(source.layout))
    if problems:
        raise CheckpointError(f"{what} does not match the config: " + "; ".join(problems)
                              + ". Is the config the one this checkpoint was trained with?")
    problems = _stack_dtype_problems(source, table, None)
    if problems:
        raise CheckpointError(f"{what}: " + "; ".join(problems))
    return table


def present_flax_view(source: Source, family: Family, config
                      ) -> tuple[list[Planned], dict[str, list[Planned]], list[Planned]]:
    """For comparing checkpoints: (the Flax view of the tensors the file has, the stacked arrays some of whose
    layers are missing (a torch-layout file) as their present layers, the tensors its config does not know as
    stored). Missing tensors are left out (a diff shows them as keys only the other side has); a tensor that
    is there but mis-shaped or not a float still fails."""
    table = family.table(config)  # every optional group: what a file lacks is shown as missing, not refused
    expected = table.expected(source.layout)
    present = {name: ref for name, ref in source.tensors.items() if name in expected}
    problems = entry_problems({name: ref.shape for name, ref in present.items()},
                              {name: expected[name] for name in present})
    problems += _dtype_problems(present, None, lenient=True)  # a diff compares any floats
    if problems:
        raise CheckpointError(f"{source.path} does not match its config: " + "; ".join(problems))
    view = flax_view(source, table, complete=False)
    partial: dict[str, list[Planned]] = {}
    if source.layout == TORCH:
        complete = {p.name for p in view}
        for rule in table.rules:
            if rule.stack is not None and rule.flax not in complete:
                partial[rule.flax] = [_layer(rule.flax, i, table.flax_shape(rule)[1:], present[name].dtype,
                                             Piece(present[name]), rule.transpose)
                                      for i, name in enumerate(table.torch_names(rule)) if name in present]
    unknown = [Planned(name, ref.shape, ref.dtype, (Piece(ref),)) for name, ref in sorted(source.tensors.items())
               if name not in expected]
    return view, partial, unknown


def layers(planned: Planned) -> list[Planned]:
    """A stacked Flax array as one tensor per layer, "name[i]" (to compare with a file missing some layers)."""
    if planned.stacked:
        pieces = planned.pieces
    else:  # one stored (L, ...) array
        pieces = tuple(Piece(planned.pieces[0].ref, i) for i in range(planned.shape[0]))
    return [_layer(planned.name, i, planned.shape[1:], planned.dtype, piece, planned.transpose)
            for i, piece in enumerate(pieces)]


def _layer(name: str, i: int, shape: tuple[int, ...], dtype: np.dtype, piece: Piece, transpose: bool) -> Planned:
    return Planned(f"{name}[{i}]", shape, dtype, (piece,), transpose=transpose)


def _anchor(table: ParamTable, layout: str) -> str:
    """The tensor whose dtype the others must share: the table's first (the embedding, in every family)."""
    rule = table.rules[0]
    return rule.flax if layout == FLAX else table.torch_names(rule)[0]


def _layer_count_problems(source: Source, table: ParamTable) -> list[str]:
    """Layer counts seen in the tensors, per stack, when they contradict the config or each other."""
    problems = []
    for stack, (what, field) in table.stack_names.items():
        want = table.dims[stack]
        stacked = [r for r in table.rules if r.stack == stack]
        if not stacked:
            continue
        if source.layout == TORCH:
            patterns = [re.compile("^" + re.escape(r.torch).replace(re.escape("{i}"), r"(\d+)") + "$")
                        for r in stacked]
            indices = {int(m.group(1)) for name in source.tensors for p in patterns if (m := p.match(name))}
            if indices and indices != set(range(want)):
                problems.append(f"{what} tensors cover layers {_ranges(sorted(indices))} but config.{field}={want} "
                                f"(layers 0-{want - 1})")
        else:
            counts: dict[int, list[str]] = {}
            for rule in stacked:
                ref = source.tensors.get(rule.flax)
                if ref is not None and len(ref.shape) >= 1:
                    counts.setdefault(ref.shape[0], []).append(rule.flax)
            if len(counts) > 1:
                problems.append(f"{what} stacked tensors disagree on the layer count: " + ", ".join(
                    f"{n} in {names[0]}" + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")
                    for n, names in sorted(counts.items())))
            elif counts and next(iter(counts)) != want:
                problems.append(f"{what} stacked tensors hold {next(iter(counts))} layers (leading axis) but "
                                f"config.{field}={want}")
    return problems


def _dtype_problems(tensors: Mapping[str, TensorRef], anchor_name: str | None, lenient: bool) -> list[str]:
    """Weights must be float32/bfloat16/float16 and all in the anchor's dtype; lenient (a cast will follow, or
    a diff compares in float64): any floats, e.g. float64 from JAX with x64, mixed as they come."""
    problems = []
    bad_kind = sorted(n for n, r in tensors.items()
                      if dtype_name(r.dtype) not in WEIGHT_DTYPES and not (lenient and r.dtype.kind == "f"))
    if bad_kind:
        fixable = not lenient and any(tensors[n].dtype.kind == "f" for n in bad_kind)
        problems.append("wrong dtype: " + _by_dtype(tensors, bad_kind) + f" (weights must be {', '.join(WEIGHT_DTYPES)}"
                        + ("; cast other floats with needle-twin convert --dtype)" if fixable else ")"))
    anchor = tensors.get(anchor_name) if anchor_name is not None else None
    if not lenient and anchor is not None and dtype_name(anchor.dtype) in WEIGHT_DTYPES:
        mixed = sorted(n for n, r in tensors.items()
                       if r.dtype != anchor.dtype and dtype_name(r.dtype) in WEIGHT_DTYPES)
        if mixed:
            problems.append("mixed dtypes: " + _by_dtype(tensors, mixed) + f" while the embedding is "
                            f"{dtype_name(anchor.dtype)} (cast all with needle-twin convert --dtype)")
    return problems


def _stack_dtype_problems(source: Source, table: ParamTable, cast: np.dtype | None) -> list[str]:
    """Layers stacked into one Flax array must share a dtype (np.stack would cast them silently), unless cast."""
    if source.layout != TORCH or cast is not None:
        return []
    problems = []
    for rule in table.rules:
        dtypes = {source.tensors[n].dtype for n in table.torch_names(rule) if n in source.tensors}
        if rule.stack is not None and len(dtypes) > 1:
            problems.append(f"{rule.torch} has mixed dtypes across layers ({', '.join(sorted(map(str, dtypes)))}); "
                            "cast the state_dict to one dtype first")
    return problems


def _by_dtype(tensors: Mapping[str, TensorRef], names: list[str]) -> str:
    """'a is float64, b is float64', or for many: '31 tensors are float64 (a, b, ...)'."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(dtype_name(tensors[n].dtype), []).append(n)
    return ", ".join(", ".join(f"{n} is {dt}" for n in group) if len(group) <= 3 else
                     f"{len(group)} tensors are {dt} ({', '.join(group[:2])}, ...)" for dt, group in groups.items())


def _config_hint(source: Source, family: Family, config) -> str:
    """Name the config fields the embedding contradicts, so a wrong config is recognised as such."""
    table = family.table(config)
    ref = source.tensors.get(_anchor(table, source.layout))
    if ref is None or len(ref.shape) != 2:
        return "Is the config the one this checkpoint was trained with?"
    vocab, d_model = ref.shape
    wrong = [f"{field}={got} but config.{field}={want}" for field, got, want in
             (("vocab_size", vocab, config.vocab_size), ("d_model", d_model, config.d_model)) if got != want]
    if wrong:
        return f"The embedding {_fmt(ref.shape)} says {', '.join(wrong)}; fix the config"
    extra = family.hint(set(source.tensors), config) if family.hint is not None else None
    return extra or "Is the config the one this checkpoint was trained with?"


def non_finite_error(path: object, bad: list[str], cast: str | None = None) -> CheckpointError:
    if cast is not None:  # the cast may be what overflowed: say so rather than blame the weights
        return CheckpointError(f"{path}: NaN or Inf values in {len(bad)} tensor(s) after the cast to {cast}: "
                               f"{', '.join(sorted(bad))}; values beyond {cast}'s range overflow to Inf (or the "
                               "source holds NaN/Inf): cast to a wider dtype (bfloat16 or float32), or read it "
                               "without a cast to check the source; nothing was converted")
    return CheckpointError(f"{path}: NaN or Inf values in {len(bad)} tensor(s): {', '.join(sorted(bad))}; "
                           "the weights are corrupt (diverged training?) and were not converted")


def _fmt(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _ranges(indices: list[int]) -> str:
    return f"{indices[0]}-{indices[-1]}" if indices == list(range(indices[0], indices[-1] + 1)) else str(indices)


# ----------------------------------------------------------------------------- views


# Source rows copied per step of a transpose: 16 sequential read streams and 32-64 byte writes per output row
# stay in cache, where numpy's own `a.T.copy()` strides across a whole column per element.
_TRANSPOSE_BAND = 16
# 2-byte values (float16/bfloat16) move 4 at a time: rows of uint64 are transposed (8 rows per step, 128 rows
# per block through a small buffer), then each uint64 is split back into its 4 values. It pays only for rows of
# >= 1024 values (slower than the plain bands on narrower ones), and not for float32.
_WIDE_MIN_COLS, _WIDE_BAND, _WIDE_ROWS = 1024, 8, 128


def copy_into(out: np.ndarray, source: np.ndarray, transpose: bool = False,
              scratch: Callable[[int], np.ndarray] | None = None) -> None:
    """out[...] = source (or source.T), cast to out's dtype (round to nearest even, overflow gives Inf).

    scratch(nbytes): a reusable uint8 buffer for the 2-byte transpose (default: fresh memory)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to Inf is reported by the finite check
        if not (transpose and source.ndim == 2 and source.shape[0] >= 2 * _TRANSPOSE_BAND):
            np.copyto(out, source.T if transpose else source, casting="unsafe")
        elif source.itemsize == 2 and source.shape[1] % 4 == 0 and source.shape[1] >= _WIDE_MIN_COLS \
                and source.strides[1] == 2:
            _transpose_wide(out, source, scratch or (lambda n: np.empty(n, np.uint8)))
        else:
            for i in range(0, source.shape[0], _TRANSPOSE_BAND):
                np.copyto(out[:, i:i + _TRANSPOSE_BAND], source[i:i + _TRANSPOSE_BAND].T, casting="unsafe")


def _transpose_wide(out: np.ndarray, source: np.ndarray, scratch: Callable[[int], np.ndarray]) -> None:
    """out = source.T for 2-byte values, 4 neighbours of a source row moving together as one uint64."""
    R, C = source.shape
    wide = source.view(np.uint64)  # (R, C/4): wide[r, c] holds source[r, 4c:4c+4]
    block = scratch(C * _WIDE_ROWS * 2).view(np.uint64)
    out4 = out.reshape(C // 4, 4, R)  # out4[c, j, r] = out[4c + j, r] = source[r, 4c + j]
    for r0 in range(0, R, _WIDE_ROWS):
        n = min(_WIDE_ROWS, R - r0)
        t = block[: C // 4 * n].reshape(C // 4, n)  # t[c, r] = wide[r0 + r, c]
        for i in range(0, n, _WIDE_BAND):
            np.copyto(t[:, i:i + _WIDE_BAND], wide[r0 + i:r0 + min(i + _WIDE_BAND, n)].T)
        values = t.view(source.dtype).reshape(C // 4, n, 4)  # values[c, r, j] = source[r0 + r, 4c + j]
        np.copyto(out4[:, :, r0:r0 + n], values.transpose(0, 2, 1), casting="unsafe")


def _out_dtype(source: Source, name: str, cast: np.dtype | None) -> np.dtype:
    return cast if cast is not None else source.tensors[name].dtype


def torch_view(source: Source, table: ParamTable, cast: np.dtype | None = None) -> list[Planned]:
    """The checkpoint as torch state_dict tensors (per layer, Linear weights (out, in)), in table order."""
    out = []
    for rule in table.rules:
        names = table.torch_names(rule)
        if source.layout == TORCH:
            out += [Planned(name, source.tensors[name].shape, _out_dtype(source, name, cast),
                            (Piece(source.tensors[name]),)) for name in names]
            continue
        ref = source.tensors[rule.flax]
        for i, name in enumerate(names):
            piece = Piece(ref, i if rule.stack else None)  # (L, ...) -> layer i
            out.append(Planned(name, table.torch_shape(rule), _out_dtype(source, rule.flax, cast), (piece,),
                               transpose=rule.transpose))
    return out


def flax_view(source: Source, table: ParamTable, cast: np.dtype | None = None, complete: bool = True
              ) -> list[Planned]:
    """The checkpoint as upstream Flax arrays (stacked layers, Dense kernels (in, out)), in table order.
    With complete=False, arrays whose source tensors are (partly) missing are left out."""
    out = []
    for rule in table.rules:
        shape = table.flax_shape(rule)
        names = [rule.flax] if source.layout == FLAX else table.torch_names(rule)
        if not complete and not all(name in source.tensors for name in names):
            continue
        if source.layout == FLAX:
            out.append(Planned(rule.flax, shape, _out_dtype(source, rule.flax, cast),
                               (Piece(source.tensors[rule.flax]),)))
            continue
        out.append(Planned(rule.flax, shape, _out_dtype(source, names[0], cast),
                           tuple(Piece(source.tensors[name]) for name in names), stacked=rule.stack is not None,
                           transpose=rule.transpose))
    return out
