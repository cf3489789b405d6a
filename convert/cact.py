"""The `.cact` container both Needle generations deploy in (NEEDLE_V2.md §7.3, NEEDLE_V3.md §7.3–7.4). numpy only.

A family supplies only its geometry (header struct and field names) and the positional tensor order
(`Layout`); everything else is one codec:

    header     the family's struct (tag first, then num_tensors, codebook_len), then codebook_len float32
               (cb2 | cb3 | cb4, already / √group)
    directory  num_tensors records of 44 bytes `<BBHIIIIQQII`: dtype (1 FP16, 2 FP32, 3 CQ, 4 RAW), ndim, pad,
               shape[4], offset, nbytes, group, bits. No names: position is meaning.
    blobs      each at a 64-byte boundary, zero gaps between them

A CQ blob of a logical (out, in) matrix, in padded to whole groups g: the packed indices (one LSB-first
bitstream per row, index k at bits [k·b, (k+1)·b)), then one fp16 group norm per (row, group). Record bits:
1 binary (analytic codebook ±√(2/π)), 2/3/4 Lloyd–Max, 5 ternary stored as signed 2-bit crumbs {3, 0, 1}.
Dequantising a group is `(cb[idx] · norm16) @ H_g` (H_g the normalised Walsh matrix).

The tail after the model records is the same in both generations: a `heads.manifest` FP16 (h,) of head codes,
each head's records, then the RAW tokenizer blob (`<IIIIIBBH` header, `<fBH` + UTF-8 per piece).

Hostile input: every size in the header and directory is checked against the file's size before anything is
allocated or read; a problem is one `CheckpointError` line naming it and the fix. Shape letters: R rows, Ip the
row width padded to whole groups, g the group size.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from convert.errors import CheckpointError, NeedleTwinError, TokenizerError, one_line

RECORD_FMT = "<BBHIIIIQQII"
RECORD_SIZE = struct.calcsize(RECORD_FMT)  # 44
ALIGN = 64
FP16, FP32, CQ, RAW = 1, 2, 3, 4
DTYPE_NAMES = {FP16: "FP16", FP32: "FP32", CQ: "CQ", RAW: "RAW"}
CB_BITS = (2, 3, 4)  # the header's codebooks (binary's and ternary's are analytic and not stored)
CODEBOOK_LEN = sum(1 << b for b in CB_BITS)  # 28
GROUP = 128  # upstream's group size, what the engine runs
MAX_GROUP = 1024  # CQ group sizes we read; bounds the g×g rotation we allocate
BINARY_RECORD_BITS, TERNARY_RECORD_BITS = 1, 5
TERNARY_UNIT = np.array([-1.2240064, 0.0, 1.2240064])  # upstream's _TERNARY_CB: 3-level Lloyd-Max of N(0,1)
_CRUMB_OF_INDEX = np.array([3, 0, 1], np.uint8)  # ternary index 0,1,2 -> signed 2-bit -1,0,+1
_INDEX_OF_CRUMB = np.array([1, 2, 255, 0], np.uint8)  # crumb 0,1,2,3 -> index; 2 (-2) is no code
TK_NORMAL, TK_UNKNOWN, TK_CONTROL, TK_USER_DEFINED, TK_BYTE = 0, 1, 2, 3, 4
TOKENIZER_HEADER_FMT, TOKENIZER_PIECE_FMT = "<IIIIIBBH", "<fBH"
SPECIAL_IDS = (0, 1, 2, 3)  # pad, eos, bos, unk: the same in both generations


# ----------------------------------------------------------------------------- CQ codebooks and rotation


@functools.cache
def lloyd_max_gaussian(bits: int, iters: int = 200, samples: int = 400_000, seed: int = 0) -> np.ndarray:
    """Upstream's `_lloyd_max_gaussian`: 2**bits Lloyd–Max centroids of N(0, 1) fitted on RandomState(seed) samples
    (float64; bits=1 is upstream's analytic ±√(2/π)). The 4-bit fit has not converged at 200 iterations, so the
    result depends on exactly these iterations and this sample stream: nothing here may be "improved"."""
    if bits == 1:
        c = math.sqrt(2.0 / math.pi)
        return np.array([-c, c])
    levels = 1 << bits
    x = np.sort(np.random.RandomState(seed).randn(samples))
    c = x[((np.arange(levels) + 0.5) / levels * samples).astype(int)].astype(np.float64)
    for _ in range(iters):
        bnd = (c[:-1] + c[1:]) / 2.0
        # Upstream assigns searchsorted(bnd, x) and averages each cell through a mask; x is sorted, so each cell
        # is the contiguous slice between these edges and its mean is the same sum.
        edges = np.concatenate([[0], np.searchsorted(x, bnd, side="right"), [samples]])
        for k in range(levels):
            lo, hi = edges[k], edges[k + 1]
            if hi > lo:  # an empty cell keeps its centroid
                c[k] = x[lo:hi].mean()
    c = np.sort(c)
    c.flags.writeable = False  # cached: shared by every caller
    return c


@functools.cache
def codebook(rec_bits: int, group: int = GROUP) -> np.ndarray:
    """Upstream's `_cq_codebook_np`: the unit centroids of a record width / √group as float32 (read-only)."""
    unit = TERNARY_UNIT if rec_bits == TERNARY_RECORD_BITS else lloyd_max_gaussian(rec_bits)
    cb = (unit / np.sqrt(group)).astype(np.float32)
    cb.flags.writeable = False
    return cb


def header_codebook(group: int = GROUP) -> np.ndarray:
    """The codebook a header stores: cb2 | cb3 | cb4."""
    return np.concatenate([codebook(b, group) for b in CB_BITS]).astype("<f4")


@functools.cache
def hadamard(group: int) -> np.ndarray:
    """Upstream's `_cq_hadamard_np`: the Sylvester–Walsh matrix of size `group` / √group, float32 (read-only)."""
    h = np.array([[1.0]], dtype=np.float32)
    while h.shape[0] < group:
        h = np.block([[h, h], [h, -h]])
    h = (h / np.sqrt(group)).astype(np.float32)
    h.flags.writeable = False
    return h


def padded(width: int, group: int = GROUP) -> int:
    """Ip: `width` rounded up to whole groups."""
    return -(-width // group) * group


def code_width(rec_bits: int) -> int:
    """Bits one packed index takes (ternary: a 2-bit crumb)."""
    return 2 if rec_bits == TERNARY_RECORD_BITS else rec_bits


def packed_row_bytes(in_pad: int, rec_bits: int) -> int:
    """Bytes of one row of packed codes."""
    return in_pad * code_width(rec_bits) // 8


def cq_nbytes(out: int, in_dim: int, rec_bits: int, group: int = GROUP) -> int:
    """A CQ blob's size: packed codes, then one fp16 norm per group."""
    in_pad = padded(in_dim, group)
    return out * packed_row_bytes(in_pad, rec_bits) + out * (in_pad // group) * 2


def nearest_index(x: np.ndarray, cb: np.ndarray) -> np.ndarray:
    """Index of the nearest codebook entry (uint8); a tie goes to the lower entry, as upstream's `_nearest_idx`."""
    flat = x.reshape(-1)
    pos = np.clip(np.searchsorted(cb, flat), 1, len(cb) - 1)
    left, right = cb[pos - 1], cb[pos]
    idx = np.where(np.abs(flat - left) <= np.abs(flat - right), pos - 1, pos)
    return idx.reshape(x.shape).astype(np.uint8)


def cq_encode(mat: np.ndarray, rec_bits: int, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """Upstream's `_cq_pack` before packing: a 2-D (R, I) matrix -> (idx (R, Ip) uint8, fp16 norms (R, Ip/g)).

    The exact numpy calls matter: `group @ H` (sgemm on (R, G, g)) and the pairwise sum of the norm are
    upstream's, so a norm within an ulp of an fp16 midpoint rounds as upstream's does.
    """
    cb, h = codebook(rec_bits, group), hadamard(group)
    w = np.asarray(mat, np.float32)
    if w.ndim != 2:
        raise ValueError(f"cq_encode takes a 2-D (rows, in) matrix, got shape {w.shape}")
    rows, width = w.shape
    pad = (-width) % group
    wp = np.pad(w, ((0, 0), (0, pad))) if pad else w
    in_pad = wp.shape[1]
    g = np.ascontiguousarray(wp.reshape(rows, in_pad // group, group), np.float32)  # (R, G, g)
    rot = g @ h  # (R, G, g)
    norm = np.sqrt((rot**2).sum(-1, keepdims=True))  # (R, G, 1)
    unit = rot / np.maximum(norm, 1e-12)
    return nearest_index(unit, cb).reshape(rows, in_pad), norm[:, :, 0].astype(np.float16)


def cq_decode(idx: np.ndarray, norm16: np.ndarray, in_dim: int, rec_bits: int, group: int = GROUP) -> np.ndarray:
    """(R, Ip) codes and (R, G) fp16 norms -> the (R, in_dim) float32 matrix: `(cb[idx] · norm) @ H`, unpadded."""
    cb, h = codebook(rec_bits, group), hadamard(group)
    rows, in_pad = idx.shape
    if idx.size and int(idx.max()) >= len(cb):
        raise CheckpointError(f"CQ code {int(idx.max())} is outside the {len(cb)}-entry codebook of record bits "
                              f"{rec_bits}; the codes are damaged, re-export the file")
    unit = cb[idx].reshape(rows, in_pad // group, group)  # (R, G, g)
    with np.errstate(invalid="ignore", over="ignore"):  # a damaged inf/nan norm gives nan, as upstream (lint says so)
        rot = unit * np.asarray(norm16).reshape(rows, in_pad // group, 1).astype(np.float32)
        return (rot @ h).reshape(rows, in_pad)[:, :in_dim]  # (R, I)


def pack_codes(idx: np.ndarray, rec_bits: int) -> np.ndarray:
    """(R, Ip) indices -> (R, row bytes) uint8: one LSB-first bitstream per row (at 4 bits the even column is the
    low nibble); ternary indices {0, 1, 2} go in as the crumbs {3, 0, 1}, i.e. the signed -1, 0, +1."""
    idx = np.asarray(idx, np.uint8)
    if rec_bits == TERNARY_RECORD_BITS:
        idx = _CRUMB_OF_INDEX[idx]
    width = code_width(rec_bits)
    rows, cols = idx.shape
    if (cols * width) % 8:
        raise ValueError(f"{cols} codes of {width} bits do not fill whole bytes")
    planes = (idx[:, :, None] >> np.arange(width, dtype=np.uint8)) & 1  # (R, Ip, b): bit j of each index
    return np.packbits(planes.reshape(rows, cols * width), axis=-1, bitorder="little")  # (R, Ip·b/8)


def unpack_codes(packed: np.ndarray, rec_bits: int, in_pad: int) -> np.ndarray:
    """Inverse of pack_codes: (R, row bytes) -> (R, Ip) uint8 (a ternary crumb 2 becomes 255: cq_decode refuses)."""
    width = code_width(rec_bits)
    rows = packed.shape[0]
    planes = np.unpackbits(packed, axis=-1, bitorder="little").reshape(rows, in_pad, width)  # (R, Ip, b)
    idx = (planes << np.arange(width, dtype=np.uint8)).sum(-1, dtype=np.uint8)
    return _INDEX_OF_CRUMB[idx] if rec_bits == TERNARY_RECORD_BITS else idx


# ----------------------------------------------------------------------------- blobs (writing)


class Blob(NamedTuple):
    """One record to write: its name (never stored), kind, logical shape and bytes."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    data: bytes
    group: int = 0
    bits: int = 0


def fp16_blob(name: str, value: Any) -> Blob:
    a = np.asarray(value, np.float16)  # upstream's np.asarray(arr, np.float16): round to nearest even
    return Blob(name, FP16, a.shape, a.astype("<f2").tobytes())


def fp32_blob(name: str, value: Any) -> Blob:
    a = np.asarray(value, np.float32)
    return Blob(name, FP32, a.shape, a.astype("<f4").tobytes())


def cq_blob(name: str, mat: Any, rec_bits: int, group: int = GROUP) -> Blob:
    """A CQ record of a 2-D (out, in) matrix: packed codes, then the fp16 group norms."""
    mat = np.asarray(mat, np.float32)
    idx, norm16 = cq_encode(mat, rec_bits, group)
    return Blob(name, CQ, tuple(mat.shape), pack_codes(idx, rec_bits).tobytes() + norm16.astype("<f2").tobytes(),
                group, rec_bits)


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack(header: bytes, blobs: list[Blob]) -> bytes:
    """Upstream's `_pack_cact` after the header (with its codebook): the directory, then each blob at the next
    64-byte boundary with zero gaps."""
    pos, offsets = len(header) + RECORD_SIZE * len(blobs), []
    for b in blobs:
        pos = align(pos)
        offsets.append(pos)
        pos += len(b.data)
    directory = b"".join(struct.pack(RECORD_FMT, b.dtype, len(b.shape), 0, *(list(b.shape) + [0] * 4)[:4], off,
                                     len(b.data), b.group, b.bits) for b, off in zip(blobs, offsets, strict=True))
    buf = bytearray(header + directory)
    for b, off in zip(blobs, offsets, strict=True):
        buf += bytes(off - len(buf))  # zero gap up to the 64-byte boundary
        buf += b.data
    return bytes(buf)


# ----------------------------------------------------------------------------- what a family declares


@dataclass(frozen=True)
class Layout:
    """A generation's `.cact`: its header struct and the positional order the header's geometry implies."""

    title: str  # "Needle 2"
    tag: int
    other_tags: Mapping[int, str]  # tag -> what such a file is and what to do with it
    header_fmt: str
    header_fields: tuple[str, ...]  # one name per header struct field; tag, num_tensors, codebook_len first
    cq_bits: tuple[int, ...]  # the record bits values it reads
    model_count: Callable[[Mapping[str, Any]], int]  # records before the heads manifest, from the header
    model_names: Callable[[Mapping[str, Any]], list[str]]  # their names (called only when the count is plausible)
    geometry_words: Callable[[Mapping[str, Any]], str]  # "L=5 layers and G=2 engram sites"
    heads: Mapping[int, tuple[str, tuple[str, ...]]]  # manifest code -> (head, its record suffixes in order)
    head_counts: Callable[[int], int | None]  # records after the model ones (tokenizer aside) -> how many heads
    heads_words: str  # "1 + 3 per probe head"
    codes_words: str  # "each of 1 (contrastive) and 2 (confidence) at most once"

    @property
    def header_size(self) -> int:
        return struct.calcsize(self.header_fmt)


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class CactRecord:
    """One directory entry (upstream's `_REC_FMT`) with the name its position gives it."""

    index: int
    name: str
    dtype: int
    ndim: int
    pad: int
    dims: tuple[int, int, int, int]  # shape[4] as stored (zero beyond ndim)
    offset: int
    nbytes: int
    group: int
    bits: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.dims[: self.ndim])

    def row(self) -> tuple[int, ...]:
        """The 11 stored columns: dtype, ndim, pad, shape[0..3], offset, nbytes, group, bits."""
        return (self.dtype, self.ndim, self.pad, *self.dims, self.offset, self.nbytes, self.group, self.bits)

    def label(self) -> str:
        return f"record {self.index} ({self.name})" if self.name else f"record {self.index}"

    def describe(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "dtype": DTYPE_NAMES.get(self.dtype, self.dtype),
                "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes, "group": self.group,
                "bits": self.bits}

    def expected_nbytes(self) -> int | None:
        """The size its dtype, shape and bits imply (None for RAW, or for a CQ record that is malformed)."""
        count = math.prod(self.shape)
        if self.dtype == FP16:
            return 2 * count
        if self.dtype == FP32:
            return 4 * count
        if self.dtype == CQ and self.ndim == 2 and valid_group(self.group) and self.bits in (1, 2, 3, 4, 5):
            return cq_nbytes(self.shape[0], self.shape[1], self.bits, self.group)
        return None


def valid_group(g: int) -> bool:
    return 8 <= g <= MAX_GROUP and g & (g - 1) == 0


def _words(values: tuple[int, ...]) -> str:
    text = [f"{v} (ternary)" if v == TERNARY_RECORD_BITS else str(v) for v in values]
    return ", ".join(text[:-1]) + " or " + text[-1]


# ----------------------------------------------------------------------------- structure (shared by read and lint)


@dataclass
class Scan:
    """What could be parsed of a file, and every problem found on the way (fatal ones stop the scan)."""

    path: Path
    size: int
    layout: Layout
    header: dict[str, Any] = field(default_factory=dict)
    codebook: np.ndarray | None = None
    records: list[CactRecord] = field(default_factory=list)
    heads: tuple[str, ...] = ()
    tokenizer: bool = False
    problems: list[str] = field(default_factory=list)
    fatal: bool = False

    def stop(self, problem: str) -> Scan:
        self.problems.append(problem)
        self.fatal = True
        return self

    @property
    def directory_end(self) -> int:
        return self.layout.header_size + 4 * self.header["codebook_len"] + RECORD_SIZE * len(self.records)


def read_at(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:  # the file shrank under us
        raise CheckpointError(f"could read only {len(data)} of {n} bytes at offset {offset}; the file changed while "
                              "being read")
    return data


def scan(path: Path, layout: Layout) -> Scan:
    """Parse header, codebook and directory, checking every size against the file before reading it."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({one_line(e)}); give an existing .cact file") from None
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; give a .cact file")
    out = Scan(path, size, layout)
    if size < layout.header_size:
        return out.stop(f"{size} bytes, shorter than the {layout.header_size}-byte .cact header: the file is empty or "
                        "truncated; re-export it")
    try:
        with open(path, "rb") as f:
            return _scan_open(f, out)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({one_line(e)}); check the file's permissions") from None
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _scan_open(f, out: Scan) -> Scan:
    layout, size, hsize = out.layout, out.size, out.layout.header_size
    head = struct.unpack(layout.header_fmt, read_at(f, 0, hsize))
    out.header = h = dict(zip(layout.header_fields, head, strict=True))
    if h["tag"] != layout.tag:
        why = layout.other_tags.get(h["tag"], f"not a {layout.title} .cact file (or its first bytes are damaged)")
        return out.stop(f"wrong tag 0x{h['tag']:08X}, expected 0x{layout.tag:08X}: {why}")
    n, cb_len = h["num_tensors"], h["codebook_len"]
    directory_end = hsize + 4 * cb_len + RECORD_SIZE * n
    if directory_end > size:
        return out.stop(f"the header announces a {cb_len}-value codebook and {n} records, which need "
                        f"{directory_end} bytes before the first blob, but the file has {size}: the header is "
                        "damaged or the file truncated; re-export it")
    out.codebook = np.frombuffer(read_at(f, hsize, 4 * cb_len), "<f4").astype(np.float32)
    table = read_at(f, hsize + 4 * cb_len, RECORD_SIZE * n)
    # Provisional names for messages: the model records' follow from the header alone (heads need the manifest).
    names = layout.model_names(h) if layout.model_count(h) <= n else []  # n is bounded by the file size
    for i in range(n):
        dtype, ndim, pad, *rest = struct.unpack_from(RECORD_FMT, table, i * RECORD_SIZE)
        dims, (offset, nbytes, group, bits) = tuple(rest[:4]), rest[4:]
        name = names[i] if i < len(names) else ""
        out.records.append(CactRecord(i, name, dtype, ndim, pad, dims, offset, nbytes, group, bits))
    for rec in out.records:
        problem = _record_problem(rec, directory_end, size, layout.cq_bits)
        if problem:
            return out.stop(problem)
    _name_records(f, out)
    return out


def _record_problem(rec: CactRecord, directory_end: int, size: int, cq_bits: tuple[int, ...]) -> str | None:
    """A directory entry that cannot be read safely (a lie about sizes, places or kinds)."""
    where = rec.label()
    if rec.dtype not in DTYPE_NAMES:
        return f"{where}: unknown dtype {rec.dtype} (1 FP16, 2 FP32, 3 CQ, 4 RAW); the directory is damaged"
    if rec.ndim > 4:
        return f"{where}: ndim {rec.ndim} is more than the 4 dimensions a record holds; the directory is damaged"
    if rec.offset < directory_end or rec.offset + rec.nbytes > size:
        return (f"{where}: its blob [{rec.offset}, {rec.offset + rec.nbytes}) lies outside the data area "
                f"[{directory_end}, {size}) of this {size}-byte file; the directory is damaged or the file truncated")
    if rec.dtype == CQ:
        if rec.ndim != 2:
            return f"{where}: a CQ record must be 2-D (out, in), got ndim {rec.ndim}; the directory is damaged"
        if not valid_group(rec.group):
            return (f"{where}: CQ group {rec.group} is not a power of two in 8..{MAX_GROUP} (upstream writes "
                    f"{GROUP}); the directory is damaged")
        if rec.bits not in cq_bits:
            return f"{where}: CQ bits {rec.bits} is not {_words(cq_bits)}; the directory is damaged"
    expected = rec.expected_nbytes()
    if expected is not None and expected != rec.nbytes:
        what = f"{DTYPE_NAMES[rec.dtype]} {rec.shape}" + (f" at {rec.bits} bits" if rec.dtype == CQ else "")
        return f"{where}: nbytes {rec.nbytes}, but {what} takes {expected}; the directory is damaged"
    return None


def _name_records(f, out: Scan) -> None:
    """Give each record its name from the header's geometry and the heads manifest; a count that fits no layout
    is a problem."""
    layout, h, records = out.layout, out.header, out.records
    base = layout.model_count(h)
    out.tokenizer = bool(records) and records[-1].dtype == RAW
    extra = len(records) - base - out.tokenizer
    count = layout.head_counts(extra) if extra > 0 else 0
    if extra < 0 or count is None:
        out.stop(f"{len(records)} records do not fit the header's geometry: {layout.geometry_words(h)} give {base} "
                 f"model records, then {layout.heads_words}, then the tokenizer; the header or the directory is "
                 "damaged")
        return
    heads: tuple[str, ...] = ()
    if count:
        manifest = records[base]
        if manifest.dtype != FP16 or manifest.shape != (count,):
            out.stop(f"record {base} should be the heads manifest, FP16 ({count},), but is "
                     f"{DTYPE_NAMES[manifest.dtype]} {manifest.shape}; the directory is damaged")
            return
        codes = np.frombuffer(read_at(f, manifest.offset, manifest.nbytes), "<f2").astype(np.float64)
        unknown = [c for c in codes if c not in layout.heads]
        if unknown or len(set(codes)) != len(codes):
            out.stop(f"record {base} (heads.manifest) holds codes {codes.tolist()}; upstream writes "
                     f"{layout.codes_words}; the file is damaged")
            return
        wanted = sum(len(layout.heads[c][1]) for c in codes)
        if 1 + wanted != extra:
            out.stop(f"record {base} (heads.manifest) lists heads {[layout.heads[c][0] for c in codes]}, which take "
                     f"{1 + wanted} records with the manifest, but {extra} follow the model records; the header or "
                     "the directory is damaged")
            return
        heads = tuple(layout.heads[c][0] for c in codes)
    out.heads = heads
    names = layout.model_names(h)
    if heads:
        suffixes = {head: s for head, s in layout.heads.values()}
        names += ["heads.manifest"] + [f"{head}.{s}" for head in heads for s in suffixes[head]]
    if out.tokenizer:
        names.append("tokenizer")
    out.records = [dataclasses.replace(r, name=name) for r, name in zip(records, names, strict=True)]


def raise_first(found: Scan) -> None:
    if found.problems:
        more = len(found.problems) - 1
        raise CheckpointError(f"{found.path}: {found.problems[0]}" + (f" (and {more} more: run lint)" if more else ""))


# ----------------------------------------------------------------------------- reading


class CactFile:
    """A `.cact` file opened for reading: header, codebook and directory are read (and checked against the file
    size) at once; tensors only when asked for. `tensor(i)` / `tensors()` give what upstream's `read_export`
    gives: FP16 and FP32 as float32 arrays, CQ dequantised with freshly computed codebooks (as upstream does, not
    the header's), RAW as bytes."""

    def __init__(self, path: str | os.PathLike, layout: Layout) -> None:
        found = scan(Path(path), layout)
        raise_first(found)
        self.layout = layout
        self.path, self.size = found.path, found.size
        self.header: dict[str, Any] = found.header
        self.codebook: np.ndarray = found.codebook
        self.records: list[CactRecord] = found.records
        self.heads: tuple[str, ...] = found.heads  # probe heads, in manifest order
        self.has_tokenizer: bool = found.tokenizer
        self._index = {r.name: r.index for r in self.records}

    def __len__(self) -> int:
        return len(self.records)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    def record(self, key: int | str) -> CactRecord:
        if isinstance(key, str):
            if key not in self._index:
                raise KeyError(f"{self.path} has no record named {key!r}; it has {', '.join(self.names)}")
            key = self._index[key]
        return self.records[key]

    def blob(self, key: int | str) -> bytes:
        rec = self.record(key)
        with open(self.path, "rb") as f:
            try:
                return read_at(f, rec.offset, rec.nbytes)
            except CheckpointError as e:
                raise CheckpointError(f"{self.path}: {rec.label()}: {e}") from None

    def codes(self, key: int | str) -> tuple[np.ndarray, np.ndarray]:
        """A CQ record's (indices (out, Ip) uint8, fp16 norms (out, Ip/g)); ternary indices are 0, 1, 2."""
        rec = self.record(key)
        if rec.dtype != CQ:
            raise CheckpointError(f"{self.path}: {rec.label()} is {DTYPE_NAMES[rec.dtype]}, not CQ")
        out, in_dim = rec.shape
        in_pad = padded(in_dim, rec.group)
        blob = self.blob(rec.index)
        row_bytes = packed_row_bytes(in_pad, rec.bits)
        n_packed = out * row_bytes
        packed = np.frombuffer(blob, np.uint8, n_packed).reshape(out, row_bytes)
        norms = np.frombuffer(blob, "<f2", offset=n_packed).astype(np.float16).reshape(out, in_pad // rec.group)
        return unpack_codes(packed, rec.bits, in_pad), norms

    def tensor(self, key: int | str) -> np.ndarray | bytes:
        rec = self.record(key)
        if rec.dtype == RAW:
            return self.blob(rec.index)
        if rec.dtype in (FP16, FP32):
            kind = "<f2" if rec.dtype == FP16 else "<f4"
            return np.frombuffer(self.blob(rec.index), kind).astype(np.float32).reshape(rec.shape)
        idx, norms = self.codes(rec.index)
        try:
            return cq_decode(idx, norms, rec.shape[1], rec.bits, rec.group)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {rec.label()}: {e}") from None

    def tensors(self) -> list[np.ndarray | bytes]:
        """Every record, positional, as upstream's `read_export` returns them."""
        return [self.tensor(i) for i in range(len(self.records))]


# ----------------------------------------------------------------------------- lint (the shared checks)


def codebook_problems(h: Mapping[str, Any], cb: np.ndarray) -> list[str]:
    if h["codebook_len"] != CODEBOOK_LEN:
        return [f"header codebook_len {h['codebook_len']}, expected {CODEBOOK_LEN} (cb2|cb3|cb4)"]
    fresh = header_codebook(GROUP)
    if not np.array_equal(cb, fresh):
        worst = float(np.max(np.abs(cb.astype(np.float64) - fresh)))
        return [f"header codebook differs from upstream's Lloyd-Max codebooks by up to {worst:.3g}: the engine "
                "decodes with the header's, upstream's reader with fresh ones; re-export the file"]
    return []


def placement_problems(found: Scan) -> list[str]:
    """Blob order, 64-byte alignment, overlaps, gaps (zero, under 64 bytes) and trailing bytes."""
    out = []
    records = sorted(found.records, key=lambda r: r.offset)
    if [r.index for r in records] != list(range(len(records))):
        out.append("blobs are not stored in record order")
    with open(found.path, "rb") as f:
        pos = found.directory_end
        for r in records:
            if r.offset % ALIGN:
                out.append(f"{r.label()}: offset {r.offset} is not {ALIGN}-byte aligned (offset % {ALIGN} = "
                           f"{r.offset % ALIGN}); the engine maps blobs at aligned addresses")
            if r.offset < pos:
                out.append(f"{r.label()}: its blob at {r.offset} overlaps the one before it (which ends at {pos})")
            elif r.offset - pos >= ALIGN:
                out.append(f"{r.label()}: {r.offset - pos} bytes of gap before its blob (upstream pads < {ALIGN})")
            elif r.offset > pos and any(read_at(f, pos, r.offset - pos)):
                out.append(f"{r.label()}: the {r.offset - pos}-byte gap before its blob is not zero")
            pos = max(pos, r.offset + r.nbytes)
    if pos != found.size:
        out.append(f"{found.size - pos} bytes after the last blob (upstream's file ends with it)")
    return out


def record_field_problems(records: list[CactRecord]) -> list[str]:
    out = []
    for r in records:
        if r.pad:
            out.append(f"{r.label()}: pad field {r.pad} is not zero")
        if any(r.dims[r.ndim:]):
            out.append(f"{r.label()}: shape entries past ndim={r.ndim} are not zero: {list(r.dims)}")
        if r.dtype != CQ and (r.group or r.bits):
            out.append(f"{r.label()}: a {DTYPE_NAMES[r.dtype]} record has group {r.group} and bits {r.bits} "
                       "(upstream writes 0, 0)")
        if r.dtype == CQ and r.group != GROUP:
            out.append(f"{r.label()}: CQ group {r.group}, upstream and the engine use {GROUP}")
    return out


def shape_problems(records: list[CactRecord], expected: list[tuple[str, int, tuple]]) -> list[str]:
    """Each record against (name, dtype, shape) of the order the geometry implies (a RAW record's shape is free)."""
    out = []
    for r, (_, dtype, shape) in zip(records, expected, strict=True):
        if r.dtype != dtype or (dtype != RAW and r.shape != shape):
            out.append(f"{r.label()}: {DTYPE_NAMES.get(r.dtype, r.dtype)} {r.shape}, but the header's geometry "
                       f"gives {DTYPE_NAMES[dtype]} {shape}")
    return out


def value_problems(found: Scan) -> list[str]:
    """Non-finite FP16/FP32 values and non-finite or negative CQ norms (what a damaged blob usually shows)."""
    out = []
    with open(found.path, "rb") as f:
        for r in found.records:
            if r.dtype in (FP16, FP32):
                values = np.frombuffer(read_at(f, r.offset, r.nbytes), "<f2" if r.dtype == FP16 else "<f4")
            elif r.dtype == CQ:
                in_pad = padded(r.shape[1], r.group)
                n_norms = r.shape[0] * (in_pad // r.group)
                values = np.frombuffer(read_at(f, r.offset + r.nbytes - 2 * n_norms, 2 * n_norms), "<f2")
                if np.any(values < 0):
                    out.append(f"{r.label()}: {int(np.sum(values < 0))} negative group norms")
            else:
                continue
            bad = int(np.count_nonzero(~np.isfinite(values)))
            if bad:
                what = "group norms" if r.dtype == CQ else "values"
                out.append(f"{r.label()}: {bad} non-finite {'fp16' if r.dtype != FP32 else 'fp32'} {what}")
    return out


def tokenizer_problems(found: Scan, vocab_size: int, exact: bool) -> list[str]:
    """The RAW tokenizer record parses, and its piece count fits the vocabulary (equal to it when `exact`)."""
    if not found.tokenizer:
        return []
    rec = found.records[-1]
    try:
        with open(found.path, "rb") as f:
            pieces = len(parse_tokenizer_blob(read_at(f, rec.offset, rec.nbytes))["pieces"])
    except (TokenizerError, CheckpointError, OSError) as e:
        return [f"{rec.label()}: {one_line(e)}"]
    if pieces > vocab_size or (exact and pieces != vocab_size):
        return [f"{rec.label()}: {pieces} pieces but the header's vocab_size is {vocab_size}"]
    return []


def lint_scan(path: str | os.PathLike, layout: Layout) -> tuple[Scan | None, list[str]]:
    """(the scan, the problems it found so far); None when the scan stopped (its problems are all there is)."""
    try:
        found = scan(Path(path), layout)
    except NeedleTwinError as e:
        return None, [str(e)]
    if found.fatal:
        return None, found.problems
    return found, list(found.problems)


# ----------------------------------------------------------------------------- tokenizer blob


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise TokenizerError("truncated or malformed varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _proto_fields(buf: bytes):
    """(field number, wire type, value) of a protobuf message: ints for varint/fixed, bytes for length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + length], pos + length
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise TokenizerError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise TokenizerError("truncated protobuf field")
        yield number, wire, value


# sentencepiece_model.proto: ModelProto {pieces = 1, normalizer_spec = 3}; SentencePiece {piece = 1, score = 2,
# type = 3}; Type {NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6}, default NORMAL;
# NormalizerSpec.add_dummy_prefix = 3, default true.
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_BYTE = 1, 2, 3, 6


def spm_pieces(model: bytes) -> list[tuple[str, float, int]]:
    """(piece, score, sentencepiece type) of every piece of a serialised SentencePiece ModelProto, in id order."""
    out = []
    for number, wire, value in _proto_fields(model):
        if number != 1 or wire != 2:
            continue
        piece, score, kind = "", 0.0, _SP_NORMAL
        for n, w, v in _proto_fields(value):
            if n == 1 and w == 2:
                piece = v.decode("utf-8")
            elif n == 2 and w == 5:
                score = struct.unpack("<f", v)[0]
            elif n == 3 and w == 0:
                kind = v
        out.append((piece, score, kind))
    return out


def spm_add_dummy_prefix(model: bytes) -> bool:
    """The model's normalizer `add_dummy_prefix` (default true): whether `encode("a")` starts with a ▁ piece."""
    for number, wire, value in _proto_fields(model):
        if number == 3 and wire == 2:
            for n, w, v in _proto_fields(value):
                if n == 3 and w == 0:
                    return bool(v)
    return True


def model_bytes(tokenizer: Any) -> bytes:
    """A SentencePiece model's bytes from a `.model` path, its bytes, or a loaded SentencePieceProcessor."""
    if hasattr(tokenizer, "serialized_model_proto"):
        return tokenizer.serialized_model_proto()
    if isinstance(tokenizer, (bytes, bytearray, memoryview)):
        return bytes(tokenizer)
    path = Path(tokenizer)
    if not path.is_file():
        raise TokenizerError(f"{path}: no such tokenizer file; give the SentencePiece .model file")
    return path.read_bytes()


def tokenizer_blob(tokenizer: Any, markers: tuple[str, ...], add_dummy_prefix: bool | None = None) -> bytes:
    """Upstream's `_tokenizer_blob`: the RAW record for a SentencePiece model. Types: control 2, unknown 1, byte 4,
    one of `markers` 3 (by text, as upstream), anything else 0. add_dummy_prefix None: measured from the model
    (Needle 3); Needle 2 writes 1."""
    model = model_bytes(tokenizer)
    try:
        pieces = spm_pieces(model)
        dummy = spm_add_dummy_prefix(model) if add_dummy_prefix is None else add_dummy_prefix
    except (TokenizerError, UnicodeDecodeError, struct.error) as e:
        raise TokenizerError(f"not a readable SentencePiece model ({one_line(e)}); give the tokenizer's .model "
                             "file") from None
    if not pieces:
        raise TokenizerError("the SentencePiece model holds no pieces; give the tokenizer's .model file")
    marked = set(markers)
    out = bytearray(struct.pack(TOKENIZER_HEADER_FMT, len(pieces), *SPECIAL_IDS, int(dummy), 1, 0))
    for piece, score, kind in pieces:
        if kind == _SP_CONTROL:
            t = TK_CONTROL
        elif kind == _SP_UNKNOWN:
            t = TK_UNKNOWN
        elif kind == _SP_BYTE:
            t = TK_BYTE
        elif piece in marked:
            t = TK_USER_DEFINED
        else:
            t = TK_NORMAL
        raw = piece.encode("utf-8")
        out += struct.pack(TOKENIZER_PIECE_FMT, score, t, len(raw)) + raw
    return bytes(out)


def parse_tokenizer_blob(blob: bytes) -> dict[str, Any]:
    """Upstream's `parse_tokenizer_blob`: {pieces, scores, types, pad_id, eos_id, bos_id, unk_id, add_dummy_prefix,
    byte_fallback}; a TokenizerError if the blob is damaged."""
    head = struct.calcsize(TOKENIZER_HEADER_FMT)
    rec = struct.calcsize(TOKENIZER_PIECE_FMT)
    if len(blob) < head:
        raise TokenizerError(f"tokenizer blob of {len(blob)} bytes is shorter than its {head}-byte header")
    n, pad, eos, bos, unk, dummy, byte_fb, _ = struct.unpack_from(TOKENIZER_HEADER_FMT, blob, 0)
    if n * rec > len(blob) - head:
        raise TokenizerError(f"tokenizer blob announces {n} pieces but holds {len(blob)} bytes")
    pieces, scores, types, off = [], [], [], head
    for i in range(n):
        if off + rec > len(blob):
            raise TokenizerError(f"tokenizer blob ends inside piece {i}")
        score, t, ln = struct.unpack_from(TOKENIZER_PIECE_FMT, blob, off)
        off += rec
        if off + ln > len(blob):
            raise TokenizerError(f"tokenizer blob ends inside piece {i}")
        try:
            pieces.append(blob[off:off + ln].decode("utf-8"))
        except UnicodeDecodeError:
            raise TokenizerError(f"tokenizer piece {i} is not UTF-8") from None
        scores.append(score)
        types.append(t)
        off += ln
    return {"pieces": pieces, "scores": scores, "types": types, "pad_id": pad, "eos_id": eos, "bos_id": bos,
            "unk_id": unk, "add_dummy_prefix": bool(dummy), "byte_fallback": bool(byte_fb)}
