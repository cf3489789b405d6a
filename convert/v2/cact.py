"""Needle 2's `.cact` deployment file (NEEDLE_V2.md §7.3): write it as upstream's `write_export` does, read it
back (`read_export`, plus names and the Flax tree), and lint it. numpy only.

Layout (all little-endian):
    header     `<29I f`, 120 bytes: tag, num_tensors, codebook_len, kv_window, kv_bits, then the geometry
               V D H K L h max_seq_len P n S s N taps dilation |O| O[4] G sites[4], then rope_theta (f32)
    codebook   codebook_len float32: cb2 | cb3 | cb4 (28 values, already / √128)
    directory  num_tensors records of 44 bytes `<BBHIIIIQQII`: dtype (1 FP16, 2 FP32, 3 CQ, 4 RAW), ndim,
               pad, shape[4], offset, nbytes, group, bits (ternary = 5). No names: position is meaning.
    blobs      each at a 64-byte boundary, zero gaps between them
The positional order (`layout_names`) is: embedding; per layer 14 records; 6 mHC a/b; 3 φ; per engram site
4; final_norm; the optional probe heads (manifest, then probes/proj/bias per head); the RAW tokenizer.

Shape letters: V vocab, D d_model, A attn_dim = H·h, K kv heads, L layers, n lanes, m = n or n² (φ columns),
N engram tables, S slots, s sub_dim, P Hadamard width, p probes, c contrastive_dim.

Hostile input: every size in the header and directory is checked against the file's size before
anything is allocated or read, and a problem is one `CheckpointError` line naming it and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from convert import plan
from convert.atomic import atomic_output
from convert.errors import CheckpointError, ConfigError, NeedleTwinError, TokenizerError, one_line
from convert.source import source_from_tree
from convert.trees import flatten_tree, unflatten_tree
from convert.v2.bits import (
    DEFAULT_BITS,
    Bits,
    BitsMap,
    bits_for,
    canonical_name,
    check_bits,
    format_bits_map,
    parse_bits_map,
)
from convert.v2.config import BOS_ID, CHAT_MARKERS, ENGRAM_TAPS, EOS_ID, PAD_ID, UNK_ID, TransformerConfig
from convert.v2.cq import (
    GROUP,
    TERNARY_RECORD_BITS,
    codebook,
    cq_decode,
    cq_encode,
    cq_nbytes,
    pack_codes,
    packed_row_bytes,
    padded,
    record_bits,
    unpack_codes,
    width_of_record,
)
from convert.v2.family import FAMILY
from convert.v2.mapping import CONFIDENCE_PROBES, CONTRASTIVE_PROBES

TAG = 0x05E12A83  # Needle 2's .cact, as upstream 2.0.3+ writes and the engine reads
OTHER_TAGS = {
    0x05E12A82: "an older exporter's file (cactus-needle <= 2.0.2 wrote 0x05E12A82 with a 5-field header that the "
                "engine does not read; upstream issue #58): re-export it with this tool or cactus-needle >= 2.0.3",
    0x05E12A84: "a Needle 3 file (tag 0x05E12A84); Needle 2 tools cannot read it",
}
HEADER_FMT, RECORD_FMT = "<29If", "<BBHIIIIQQII"
HEADER_SIZE, RECORD_SIZE = struct.calcsize(HEADER_FMT), struct.calcsize(RECORD_FMT)  # 120, 44
ALIGN = 64
FP16, FP32, CQ, RAW = 1, 2, 3, 4
DTYPE_NAMES = {FP16: "FP16", FP32: "FP32", CQ: "CQ", RAW: "RAW"}
CB_BITS = (2, 3, 4)  # the header's codebooks (ternary's is analytic and not stored)
CODEBOOK_LEN = sum(1 << b for b in CB_BITS)  # 28
MAX_SLOTS = 4  # the header holds 4 engram orders and 4 sites
MAX_GROUP = 1024  # CQ group sizes we read (upstream writes 128); bounds the g×g rotation we allocate
HEAD_CODES = {"contrastive_head": 1, "confidence_head": 2}  # upstream's manifest codes, in canonical order
HEAD_PROBES = {"contrastive_head": CONTRASTIVE_PROBES, "confidence_head": CONFIDENCE_PROBES}
HEAD_GROUP = {"contrastive_head": "contrastive", "confidence_head": "confidence"}
LOG_TEMP_INIT = math.log(0.07)  # upstream's contrastive_head/log_temp initialiser (not exported)
TK_NORMAL, TK_UNKNOWN, TK_CONTROL, TK_USER_DEFINED, TK_BYTE = 0, 1, 2, 3, 4
TOKENIZER_HEADER_FMT, TOKENIZER_PIECE_FMT = "<IIIIIBBH", "<fBH"

HEADER_FIELDS = (
    "tag", "num_tensors", "codebook_len", "kv_window", "kv_bits", "vocab_size", "d_model", "num_heads",
    "num_kv_heads", "num_layers", "head_dim", "max_seq_len", "hada_n", "mhc_lanes", "engram_slots",
    "engram_sub_dim", "num_engram_tables", "engram_conv_taps", "engram_conv_dilation", "num_engram_orders",
    "order0", "order1", "order2", "order3", "num_engram_sites", "site0", "site1", "site2", "site3", "rope_theta",
)
LAYER_RECORDS = ("norm_in", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "gate_proj", "out_proj",
                 "post_norm", "attn_gate", "pre_hada", "d1", "d2", "d3")
MHC_FP16 = ("mhc_a_pre", "mhc_a_post", "mhc_a_res", "mhc_b_pre", "mhc_b_post", "mhc_b_res")
MHC_PHI = ("mhc_phi_pre", "mhc_phi_post", "mhc_phi_res")
SITE_RECORDS = ("tables", "key_proj", "value_proj", "taps")

# Flax paths of the per-layer records (stacked on axis 0 in the tree); `True`: a kernel stored transposed (out, in).
_BLOCK = "stack/layers/block"
_LAYER_PATHS = {
    "norm_in": (f"{_BLOCK}/ZCRMSNorm_0/scale", False), "q_proj": (f"{_BLOCK}/self_attn/q_proj/kernel", True),
    "k_proj": (f"{_BLOCK}/self_attn/k_proj/kernel", True), "v_proj": (f"{_BLOCK}/self_attn/v_proj/kernel", True),
    "q_norm": (f"{_BLOCK}/self_attn/q_norm/scale", False), "k_norm": (f"{_BLOCK}/self_attn/k_norm/scale", False),
    "gate_proj": (f"{_BLOCK}/self_attn/gate_proj/kernel", True),
    "out_proj": (f"{_BLOCK}/self_attn/out_proj/kernel", True),
    "post_norm": (f"{_BLOCK}/post_attn_norm/scale", False), "attn_gate": (f"{_BLOCK}/attn_gate", False),
    "pre_hada": (f"{_BLOCK}/pre_hada_norm/scale", False), "d1": (f"{_BLOCK}/hadamard_mlp/d1", False),
    "d2": (f"{_BLOCK}/hadamard_mlp/d2", False), "d3": (f"{_BLOCK}/hadamard_mlp/d3", False),
}


# ----------------------------------------------------------------------------- geometry and layout


class Geometry(NamedTuple):
    """What the header stores about the model (and what the positional layout follows from)."""

    vocab_size: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    head_dim: int
    max_seq_len: int
    hada_n: int
    mhc_lanes: int
    engram_slots: int
    engram_sub_dim: int
    num_engram_tables: int
    engram_orders: tuple[int, ...]
    engram_layers: tuple[int, ...]
    rope_theta: float
    kv_window: int
    kv_bits: int

    @classmethod
    def of_config(cls, config: TransformerConfig, kv_window: int) -> Geometry:
        return cls(config.vocab_size, config.d_model, config.num_heads, config.num_kv_heads, config.num_layers,
                   config.head_dim, config.max_seq_len, config.hada_dim, config.mhc_lanes, config.engram_slots,
                   config.engram_sub_dim, config.num_engram_tables, tuple(config.engram_orders),
                   tuple(config.engram_layers), float(config.rope_theta), kv_window,
                   int(config.kv_bits or 8))  # upstream: int(getattr(config, "kv_bits", 8) or 8)

    @classmethod
    def of_header(cls, h: Mapping[str, Any]) -> Geometry:
        orders = tuple(h[f"order{i}"] for i in range(min(h["num_engram_orders"], MAX_SLOTS)))
        sites = tuple(h[f"site{i}"] for i in range(min(h["num_engram_sites"], MAX_SLOTS)))
        return cls(h["vocab_size"], h["d_model"], h["num_heads"], h["num_kv_heads"], h["num_layers"], h["head_dim"],
                   h["max_seq_len"], h["hada_n"], h["mhc_lanes"], h["engram_slots"], h["engram_sub_dim"],
                   h["num_engram_tables"], orders, sites, h["rope_theta"], h["kv_window"], h["kv_bits"])

    @property
    def attn_dim(self) -> int:  # A
        return self.num_heads * self.head_dim


def model_record_count(num_layers: int, num_sites: int) -> int:
    """Records through final_norm: 1 + 14·L + 9 + 4·G + 1."""
    return 1 + len(LAYER_RECORDS) * num_layers + len(MHC_FP16) + len(MHC_PHI) + len(SITE_RECORDS) * num_sites + 1


def layout_names(num_layers: int, num_sites: int, heads: tuple[str, ...] = (), tokenizer: bool = False) -> list[str]:
    """Upstream's record names (`export._tensors`) in file order; `heads` in manifest order."""
    names = ["embedding"]
    names += [f"layer{i:02d}.{r}" for i in range(num_layers) for r in LAYER_RECORDS]
    names += list(MHC_FP16) + list(MHC_PHI)
    names += [f"engram{g}.{r}" for g in range(num_sites) for r in SITE_RECORDS]
    names.append("final_norm")
    if heads:
        names.append("heads.manifest")
        names += [f"{h}.{r}" for h in heads for r in ("probes", "proj", "bias")]
    if tokenizer:
        names.append("tokenizer")
    return names


def expected_records(geo: Geometry, heads: Mapping[str, int], tokenizer: bool) -> list[tuple[str, int, tuple]]:
    """(name, dtype, shape) of every record a file of this geometry holds; heads: {head: its output width}."""
    V, D, A, K, h, L = geo.vocab_size, geo.d_model, geo.attn_dim, geo.num_kv_heads, geo.head_dim, geo.num_layers
    n, N, S, s, P = geo.mhc_lanes, geo.num_engram_tables, geo.engram_slots, geo.engram_sub_dim, geo.hada_n
    layer = {"norm_in": (FP16, (D,)), "q_proj": (CQ, (A, D)), "k_proj": (CQ, (K * h, D)), "v_proj": (CQ, (K * h, D)),
             "q_norm": (FP16, (h,)), "k_norm": (FP16, (h,)), "gate_proj": (CQ, (A, D)), "out_proj": (CQ, (D, A)),
             "post_norm": (FP16, (D,)), "attn_gate": (FP16, (1,)), "pre_hada": (FP16, (D,)),
             "d1": (FP16, (P,)), "d2": (FP16, (P,)), "d3": (FP16, (P,))}
    out = [("embedding", CQ, (V, D))]
    out += [(f"layer{i:02d}.{r}", *layer[r]) for i in range(L) for r in LAYER_RECORDS]
    out += [("mhc_a_pre", FP16, (L,)), ("mhc_a_post", FP16, (L,)), ("mhc_a_res", FP16, (L,)),
            ("mhc_b_pre", FP16, (L, n)), ("mhc_b_post", FP16, (L, n)), ("mhc_b_res", FP16, (L, n, n)),
            ("mhc_phi_pre", CQ, (L * n, n * D)), ("mhc_phi_post", CQ, (L * n, n * D)),
            ("mhc_phi_res", CQ, (L * n * n, n * D))]
    for g in range(len(geo.engram_layers)):
        out += [(f"engram{g}.tables", CQ, (N * S, s)), (f"engram{g}.key_proj", CQ, (D, N * s)),
                (f"engram{g}.value_proj", CQ, (D, N * s)), (f"engram{g}.taps", FP16, (ENGRAM_TAPS, D))]
    out.append(("final_norm", FP16, (D,)))
    if heads:
        out.append(("heads.manifest", FP16, (len(heads),)))
        for head, width in heads.items():
            p = HEAD_PROBES[head]
            out += [(f"{head}.probes", FP16, (p, D)), (f"{head}.proj", FP16, (width, p * D)),
                    (f"{head}.bias", FP16, (width,))]
    if tokenizer:
        out.append(("tokenizer", RAW, ()))
    return out


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

    def expected_nbytes(self) -> int | None:
        """The size its dtype, shape and bits imply (None for RAW, or for a CQ record that is malformed)."""
        count = math.prod(self.shape)
        if self.dtype == FP16:
            return 2 * count
        if self.dtype == FP32:
            return 4 * count
        if self.dtype == CQ and self.ndim == 2 and _valid_group(self.group) and self.bits in (2, 3, 4, 5):
            return cq_nbytes(self.shape[0], self.shape[1], self.bits, self.group)
        return None


def _valid_group(g: int) -> bool:
    return 8 <= g <= MAX_GROUP and g & (g - 1) == 0


# ----------------------------------------------------------------------------- structure (shared by read and lint)


@dataclass
class _Scan:
    """What could be parsed of a file, and every problem found on the way (fatal ones stop the scan)."""

    path: Path
    size: int
    header: dict[str, Any] = field(default_factory=dict)
    codebook: np.ndarray | None = None
    records: list[CactRecord] = field(default_factory=list)
    heads: tuple[str, ...] = ()
    tokenizer: bool = False
    problems: list[str] = field(default_factory=list)
    fatal: bool = False

    def stop(self, problem: str) -> _Scan:
        self.problems.append(problem)
        self.fatal = True
        return self


def _read_at(f, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:  # the file shrank under us
        raise CheckpointError(f"could read only {len(data)} of {n} bytes at offset {offset}; the file changed while "
                              "being read")
    return data


def _scan(path: Path) -> _Scan:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({one_line(e)}); give an existing .cact file") from None
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory; give a .cact file")
    scan = _Scan(path, size)
    if size < HEADER_SIZE:
        return scan.stop(f"{size} bytes, shorter than the {HEADER_SIZE}-byte .cact header: the file is empty or "
                         "truncated; re-export it")
    try:
        with open(path, "rb") as f:
            return _scan_open(f, scan)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({one_line(e)}); check the file's permissions") from None
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _scan_open(f, scan: _Scan) -> _Scan:
    size = scan.size
    head = struct.unpack(HEADER_FMT, _read_at(f, 0, HEADER_SIZE))
    scan.header = h = dict(zip(HEADER_FIELDS, head, strict=True))
    if h["tag"] != TAG:
        why = OTHER_TAGS.get(h["tag"], "not a Needle 2 .cact file (or its first bytes are damaged)")
        return scan.stop(f"wrong tag 0x{h['tag']:08X}, expected 0x{TAG:08X}: {why}")
    n, cb_len = h["num_tensors"], h["codebook_len"]
    directory_end = HEADER_SIZE + 4 * cb_len + RECORD_SIZE * n
    if directory_end > size:
        return scan.stop(f"the header announces a {cb_len}-value codebook and {n} records, which need "
                         f"{directory_end} bytes before the first blob, but the file has {size}: the header is "
                         "damaged or the file truncated; re-export it")
    scan.codebook = np.frombuffer(_read_at(f, HEADER_SIZE, 4 * cb_len), "<f4").astype(np.float32)
    table = _read_at(f, HEADER_SIZE + 4 * cb_len, RECORD_SIZE * n)
    # Provisional names for messages: the model records' follow from L and G alone (heads need the manifest).
    L, G = h["num_layers"], min(h["num_engram_sites"], MAX_SLOTS)
    names = layout_names(L, G) if model_record_count(L, G) <= n else []  # n is bounded by the file size
    for i in range(n):
        dtype, ndim, pad, *rest = struct.unpack_from(RECORD_FMT, table, i * RECORD_SIZE)
        dims, (offset, nbytes, group, bits) = tuple(rest[:4]), rest[4:]
        name = names[i] if i < len(names) else ""
        scan.records.append(CactRecord(i, name, dtype, ndim, pad, dims, offset, nbytes, group, bits))
    for rec in scan.records:
        problem = _record_problem(rec, directory_end, size)
        if problem:
            return scan.stop(problem)
    _name_records(f, scan)
    return scan


def _record_problem(rec: CactRecord, directory_end: int, size: int) -> str | None:
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
        if not _valid_group(rec.group):
            return (f"{where}: CQ group {rec.group} is not a power of two in 8..{MAX_GROUP} (upstream writes "
                    f"{GROUP}); the directory is damaged")
        if rec.bits not in (2, 3, 4, TERNARY_RECORD_BITS):
            return f"{where}: CQ bits {rec.bits} is not 2, 3, 4 or 5 (ternary); the directory is damaged"
    expected = rec.expected_nbytes()
    if expected is not None and expected != rec.nbytes:
        what = f"{DTYPE_NAMES[rec.dtype]} {rec.shape}" + (f" at {rec.bits} bits" if rec.dtype == CQ else "")
        return f"{where}: nbytes {rec.nbytes}, but {what} takes {expected}; the directory is damaged"
    return None


def _name_records(f, scan: _Scan) -> None:
    """Give each record its §7.3 name from the header's L and G (and the heads manifest); a count that fits no
    layout is a problem."""
    h, records = scan.header, scan.records
    L, G = h["num_layers"], min(h["num_engram_sites"], MAX_SLOTS)
    base = model_record_count(L, G)
    scan.tokenizer = bool(records) and records[-1].dtype == RAW
    extra = len(records) - base - scan.tokenizer
    heads: tuple[str, ...] = ()
    if extra and (extra < 4 or (extra - 1) % 3):  # heads: a manifest, then 3 records per head
        scan.stop(f"{len(records)} records do not fit the header's geometry: L={L} layers and G={G} engram sites "
                  f"give {base} model records, then 1 + 3 per probe head, then the tokenizer; the header or the "
                  "directory is damaged")
        return
    if extra:
        manifest = records[base]
        count = (extra - 1) // 3
        if manifest.dtype != FP16 or manifest.shape != (count,):
            scan.stop(f"record {base} should be the heads manifest, FP16 ({count},), but is "
                      f"{DTYPE_NAMES[manifest.dtype]} {manifest.shape}; the directory is damaged")
            return
        codes = np.frombuffer(_read_at(f, manifest.offset, manifest.nbytes), "<f2").astype(np.float64)
        by_code = {c: name for name, c in HEAD_CODES.items()}
        unknown = [c for c in codes if c not in by_code]
        if unknown or len(set(codes)) != len(codes):
            scan.stop(f"record {base} (heads.manifest) holds codes {codes.tolist()}; upstream writes each of 1 "
                      "(contrastive) and 2 (confidence) at most once; the file is damaged")
            return
        heads = tuple(by_code[c] for c in codes)
    scan.heads = heads
    names = layout_names(L, G, heads, scan.tokenizer)
    scan.records = [dataclasses.replace(r, name=name) for r, name in zip(records, names, strict=True)]


def _raise_first(scan: _Scan) -> None:
    if scan.problems:
        more = len(scan.problems) - 1
        raise CheckpointError(f"{scan.path}: {scan.problems[0]}" + (f" (and {more} more: run lint)" if more else ""))


# ----------------------------------------------------------------------------- reading


class CactFile:
    """A `.cact` file opened for reading: header, codebook and directory are read (and checked against the file
    size) at once; tensors only when asked for. `tensor(i)` / `tensors()` give what upstream's `read_export`
    gives: FP16 and FP32 as float32 arrays, CQ dequantised with freshly computed codebooks (as upstream does, not
    the header's), RAW as bytes."""

    def __init__(self, path: str | os.PathLike) -> None:
        scan = _scan(Path(path))
        _raise_first(scan)
        self.path, self.size = scan.path, scan.size
        self.header: dict[str, Any] = scan.header
        self.codebook: np.ndarray = scan.codebook
        self.records: list[CactRecord] = scan.records
        self.heads: tuple[str, ...] = scan.heads  # probe heads, in manifest order
        self.has_tokenizer: bool = scan.tokenizer
        self._index = {r.name: r.index for r in self.records}

    def __len__(self) -> int:
        return len(self.records)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def geometry(self) -> Geometry:
        return Geometry.of_header(self.header)

    @property
    def info(self) -> dict[str, Any]:
        """Upstream's `read_export` info dict (same keys, same order)."""
        h = self.header
        return {"num_tensors": h["num_tensors"], "codebook": self.codebook.copy(),
                **{k: h[k] for k in HEADER_FIELDS[3:19]},
                "engram_orders": self.geometry.engram_orders, "engram_layers": self.geometry.engram_layers,
                "rope_theta": h["rope_theta"]}

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
                return _read_at(f, rec.offset, rec.nbytes)
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
            return np.frombuffer(self.blob(rec.index), "<f2" if rec.dtype == FP16 else "<f4").astype(np.float32
                                                                                                   ).reshape(rec.shape)
        idx, norms = self.codes(rec.index)
        try:
            return cq_decode(idx, norms, rec.shape[1], width_of_record(rec.bits), rec.group)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: {rec.label()}: {e}") from None

    def tensors(self) -> list[np.ndarray | bytes]:
        """Every record, positional, as upstream's `read_export` returns them."""
        return [self.tensor(i) for i in range(len(self.records))]

    @property
    def config(self) -> TransformerConfig:
        return _config_from(self)


def read_cact(path: str | os.PathLike) -> CactFile:
    """Open a `.cact` file (one CheckpointError line if it is damaged or not one)."""
    return CactFile(path)


def read_export(path: str | os.PathLike) -> tuple[dict[str, Any], list[np.ndarray | bytes]]:
    """Upstream's `read_export(path)` -> (info, tensors)."""
    cact = CactFile(path)
    return cact.info, cact.tensors()


# ----------------------------------------------------------------------------- back to the Flax tree


@dataclass(frozen=True)
class Lossy:
    """What `to_params` could not give back exactly."""

    absent: tuple[str, ...]  # optional groups the file does not hold (the MTP head is never exported)
    synthesised: dict[str, str]  # Flax path -> where its value came from
    cq: tuple[str, ...]  # Flax paths dequantised from CQ codes (lossy)
    fp16: tuple[str, ...]  # Flax paths rounded to fp16 by the export
    dropped: tuple[str, ...]  # records with no place in the tree
    config_defaults: tuple[str, ...]  # config fields the file does not store (upstream's defaults were used)
    notes: tuple[str, ...] = ()  # header values the rebuilt config cannot say exactly

    def lines(self) -> list[str]:
        out = [f"absent: {', '.join(self.absent)}"] if self.absent else []
        out += [f"synthesised {p}: {why}" for p, why in self.synthesised.items()]
        out += [f"lossy (CQ dequantised): {len(self.cq)} leaves", f"rounded to fp16: {len(self.fp16)} leaves"]
        out += [f"dropped: {', '.join(self.dropped)}"] if self.dropped else []
        out += [f"config fields not stored (defaults): {', '.join(self.config_defaults)}"]
        return out + list(self.notes)


class CactParams(NamedTuple):
    params: dict[str, Any]  # the Needle 2 Flax tree, float32 leaves
    config: TransformerConfig
    lossy: Lossy


_NOT_STORED = ("pad_token_id", "dtype", "flash", "act_bits", "remat", "scan_unroll")


def _config_from(cact: CactFile) -> TransformerConfig:
    """The TransformerConfig the header describes: attn_dim = H·h, E = N/|O|, contrastive_dim from the head,
    kv_window 0 when the header holds the budget window, weight_bits the bits map the records imply."""
    geo = cact.geometry
    orders = geo.engram_orders
    kwargs: dict[str, Any] = {
        "vocab_size": geo.vocab_size, "d_model": geo.d_model, "attn_dim": geo.attn_dim, "num_heads": geo.num_heads,
        "num_kv_heads": geo.num_kv_heads, "num_layers": geo.num_layers, "max_seq_len": geo.max_seq_len,
        "rope_theta": float(geo.rope_theta), "engram_orders": orders, "engram_slots": geo.engram_slots,
        "engram_layers": geo.engram_layers, "mhc_lanes": geo.mhc_lanes, "kv_bits": geo.kv_bits,
    }
    if "contrastive_head" in cact.heads:
        kwargs["contrastive_dim"] = cact.record("contrastive_head.proj").shape[0]
    if orders and geo.num_engram_tables % len(orders) == 0:
        heads = geo.num_engram_tables // len(orders)
        kwargs["engram_heads"] = 0 if heads == max(1, geo.d_model // (len(orders) * 128)) else heads
    implied = implied_bits_map(cact.records)
    if implied is not None:
        kwargs["weight_bits"] = format_bits_map(*implied)
    try:
        config = TransformerConfig(**kwargs)
        if geo.kv_window not in (0, config.kv_budget_window):  # 0: "size it from the budget", as upstream's default
            config = config.replace(kv_window=geo.kv_window)
    except ConfigError as e:
        raise CheckpointError(f"{cact.path}: the header describes no valid Needle 2 config ({e}); the header is "
                              "damaged") from None
    problems = _geometry_problems(cact.header, config)
    if problems:
        raise CheckpointError(f"{cact.path}: header: {problems[0]}")
    return config


def implied_bits_map(records: list[CactRecord]) -> tuple[BitsMap, Bits] | None:
    """The (bits map, default) upstream's `_bits_for` would need to give these CQ records their widths: the most
    common width is the default, every other canonical name gets an entry. None if no map can (two records of
    one canonical name, e.g. layer00.q_proj and layer01.q_proj, with different widths)."""
    widths: dict[str, set[int]] = {}
    for r in records:
        if r.dtype == CQ:
            widths.setdefault(canonical_name(r.name), set()).add(r.bits)
    if any(len(w) > 1 for w in widths.values()):
        return None
    if not widths:
        return {}, DEFAULT_BITS
    per_name = {k: width_of_record(next(iter(w))) for k, w in widths.items()}
    counts = Counter(per_name.values())
    default = max(counts, key=lambda b: (counts[b], b == DEFAULT_BITS))
    bits_map = {k: b for k, b in per_name.items() if b != default}
    if any(bits_for(r.name, bits_map, default) != width_of_record(r.bits) for r in records if r.dtype == CQ):
        return None  # a key that prefixes another name (cannot happen for upstream's names)
    return bits_map, default


def to_params(cact: CactFile | str | os.PathLike) -> CactParams:
    """The Needle 2 Flax tree a `.cact` holds (float32; transposes and reshapes undone), the config its header
    gives, and what is lossy: CQ leaves are dequantised, FP16 leaves were rounded, the MTP head is absent,
    `contrastive_head/log_temp` (not exported) is upstream's initial ln(0.07), the contrastive head's synthetic
    zero bias is dropped."""
    if not isinstance(cact, CactFile):
        cact = CactFile(cact)
    config = cact.config
    problems = _shape_problems(cact.records, cact.geometry, cact.heads, cact.has_tokenizer)
    if problems:
        raise CheckpointError(f"{cact.path}: {problems[0]}" + (f" (and {len(problems) - 1} more: run lint)"
                                                                if len(problems) > 1 else ""))
    geo = cact.geometry
    L, n, D, N, S, s = geo.num_layers, geo.mhc_lanes, geo.d_model, geo.num_engram_tables, geo.engram_slots, \
        geo.engram_sub_dim
    t = cact.tensor
    flat: dict[str, np.ndarray] = {"embedding/embedding": t("embedding")}
    cq_paths, fp16_paths = ["embedding/embedding"], []
    for rec_name, (path, transposed) in _LAYER_PATHS.items():
        per_layer = [t(f"layer{i:02d}.{rec_name}") for i in range(L)]
        if transposed:
            per_layer = [w.T for w in per_layer]  # (out, in) -> (in, out)
        stacked = np.stack(per_layer)  # (L, ...)
        flat[path] = stacked.reshape(L) if rec_name == "attn_gate" else stacked  # (L, 1) -> (L,)
        (cq_paths if transposed else fp16_paths).append(path)
    for name in MHC_FP16:
        flat[f"stack/{name}"] = t(name)
        fp16_paths.append(f"stack/{name}")
    for name in MHC_PHI:
        phi = t(name)  # (L·m, n·D)
        flat[f"stack/{name}"] = np.ascontiguousarray(phi.reshape(L, -1, n * D).transpose(0, 2, 1))  # (L, n·D, m)
        cq_paths.append(f"stack/{name}")
    flat["stack/final_norm/scale"] = t("final_norm")
    fp16_paths.append("stack/final_norm/scale")
    for g in range(len(geo.engram_layers)):
        flat[f"engrams_{g}/embedding"] = t(f"engram{g}.tables").reshape(N, S, s)  # (N·S, s) -> (N, S, s)
        flat[f"engrams_{g}/key_proj/kernel"] = np.ascontiguousarray(t(f"engram{g}.key_proj").T)  # (N·s, D)
        flat[f"engrams_{g}/value_proj/kernel"] = np.ascontiguousarray(t(f"engram{g}.value_proj").T)  # (N·s, D)
        flat[f"engrams_{g}/taps"] = t(f"engram{g}.taps")
        cq_paths += [f"engrams_{g}/embedding", f"engrams_{g}/key_proj/kernel", f"engrams_{g}/value_proj/kernel"]
        fp16_paths.append(f"engrams_{g}/taps")
    synthesised, dropped = {}, []
    for head in cact.heads:
        flat[f"{head}/probes"] = t(f"{head}.probes")
        flat[f"{head}/proj/kernel"] = np.ascontiguousarray(t(f"{head}.proj").T)  # (out, p·D) -> (p·D, out)
        fp16_paths += [f"{head}/probes", f"{head}/proj/kernel"]
        bias = t(f"{head}.bias")
        if head == "contrastive_head":
            if np.any(bias != 0):
                raise CheckpointError(f"{cact.path}: contrastive_head.bias is not zero; upstream's contrastive head "
                                      "has no bias and its exporter writes zeros, so this file was not written by "
                                      "it and its head cannot be put into a Needle 2 tree")
            dropped.append("contrastive_head.bias (upstream's synthetic zeros)")
            flat["contrastive_head/log_temp"] = np.asarray(LOG_TEMP_INIT, np.float32)
            synthesised["contrastive_head/log_temp"] = "ln(0.07) as float32, upstream's initialiser (not exported)"
        else:
            flat[f"{head}/proj/bias"] = bias
            fp16_paths.append(f"{head}/proj/bias")
    if cact.has_tokenizer:
        dropped.append("tokenizer (RAW)")
    absent = ("mtp",) + tuple(HEAD_GROUP[h] for h in HEAD_CODES if h not in cact.heads)
    not_stored = _NOT_STORED + (() if "contrastive_head" in cact.heads else ("contrastive_dim",))
    notes = []
    if config.effective_kv_window != geo.kv_window:
        notes.append(f"the header's kv_window is {geo.kv_window}; config.effective_kv_window gives "
                     f"{config.effective_kv_window} (upstream's build writes the latter)")
    if implied_bits_map(cact.records) is None:
        notes.append("the records' widths fit no bits map (one tensor has different widths in different layers); "
                     "config.weight_bits is left empty")
    lossy = Lossy(absent, synthesised, tuple(cq_paths), tuple(fp16_paths), tuple(dropped), not_stored, tuple(notes))
    return CactParams(unflatten_tree(flat), config, lossy)


# ----------------------------------------------------------------------------- writing


def resolve_bits(config: TransformerConfig, bits: Bits | None, bits_map: str | None) -> Bits | tuple[BitsMap, Bits]:
    """What upstream's build exports with: a bits map if given, else `bits`, else the config's weight_bits map,
    else 4."""
    if bits_map:
        return parse_bits_map(bits_map)
    if bits is not None:
        return check_bits(bits)
    if config.weight_bits:
        return parse_bits_map(config.weight_bits)
    return DEFAULT_BITS


def write_cact(params: Mapping[str, Any], config: TransformerConfig, path: str | os.PathLike, bits: Bits | None = None,
               bits_map: str | None = None, tokenizer: Any = None, kv_window: int | None = None, *,
               force: bool = False) -> dict[str, Any]:
    """Write the `.cact` upstream's `write_export(params, config, path, bits, bits_map=..., tokenizer=...,
    kv_window=...)` writes, byte for byte; returns upstream's {"path", "bytes", "tensors"}.

    bits: 2, 3, 4 or 1.58; bits_map: e.g. "default=2,embedding=4,attn.q_proj=3" (takes precedence, as upstream);
    neither: the config's weight_bits map if set, else 4 (what `needle build` does). kv_window: the header's
    window (default: config.effective_kv_window, what `needle build` writes). tokenizer: a SentencePiece
    `.model` file (path or bytes, or a loaded SentencePieceProcessor) for the RAW tokenizer record. The file is
    written atomically (nothing is left behind on failure) and never over an existing one unless force.

    Refused where upstream's exporter would write a file that does not describe the model: more than 4 engram
    orders or sites (its header holds 4 of each and it silently drops the rest, so the engine would hash with
    the wrong orders and skip sites), header values that do not fit its u32 fields, and a tokenizer whose size
    is not the vocabulary's (upstream refuses that too).
    """
    with atomic_output(Path(path), force=force) as tmp:  # checks the target before any work
        buf = build_cact(params, config, bits, bits_map, tokenizer, kv_window)
        with open(tmp, "wb") as f:
            f.write(buf)
    return {"path": str(path), "bytes": len(buf), "tensors": struct.unpack_from("<I", buf, 4)[0]}


def build_cact(params: Mapping[str, Any], config: TransformerConfig, bits: Bits | None = None,
               bits_map: str | None = None, tokenizer: Any = None, kv_window: int | None = None) -> bytes:
    """The bytes write_cact writes (upstream's `build_export`), without touching the disk."""
    if not isinstance(config, TransformerConfig):
        raise ConfigError(f"a .cact needs a convert.v2.TransformerConfig, got {type(config).__name__}")
    window = config.effective_kv_window if kv_window is None else kv_window
    geo = Geometry.of_config(config, window)
    _check_representable(geo)
    spec = resolve_bits(config, bits, bits_map)
    tok_blob = None
    if tokenizer is not None:
        tok_blob = tokenizer_blob(tokenizer)
        pieces = struct.unpack_from("<I", tok_blob)[0]
        if pieces != config.vocab_size:  # upstream refuses this too
            raise TokenizerError(f"the tokenizer has {pieces} pieces but config.vocab_size is {config.vocab_size}; "
                                 "give the tokenizer this model was trained with")
    plan.check_names(source_from_tree(params), FAMILY, config, "params")
    blobs = _blobs({k: np.asarray(v) for k, v in flatten_tree(params).items()}, geo, spec)
    if tok_blob is not None:
        blobs.append(_Blob("tokenizer", RAW, (), tok_blob))
    return _pack(blobs, geo)


def _check_representable(geo: Geometry) -> None:
    for what, values in (("engram_orders", geo.engram_orders), ("engram_layers", geo.engram_layers)):
        if len(values) > MAX_SLOTS:
            raise ConfigError(f"config.{what}={list(values)} has {len(values)} entries; a .cact header holds "
                              f"{MAX_SLOTS} (upstream's exporter silently drops the rest, and the engine would run a "
                              "different model); use at most 4")
    ints = {k: v for k, v in geo._asdict().items() if isinstance(v, int)}
    bad = {k: v for k, v in ints.items() if not 0 <= v < 2**32}
    if bad:
        k, v = next(iter(bad.items()))
        raise ConfigError(f"{k}={v} does not fit the .cact header's unsigned 32-bit field; use 0 <= {k} < 2**32")


def _header(geo: Geometry, num_tensors: int) -> bytes:
    orders = list(geo.engram_orders) + [0] * (MAX_SLOTS - len(geo.engram_orders))
    sites = list(geo.engram_layers) + [0] * (MAX_SLOTS - len(geo.engram_layers))
    head = struct.pack(HEADER_FMT, TAG, num_tensors, CODEBOOK_LEN, geo.kv_window, geo.kv_bits, geo.vocab_size,
                       geo.d_model, geo.num_heads, geo.num_kv_heads, geo.num_layers, geo.head_dim, geo.max_seq_len,
                       geo.hada_n, geo.mhc_lanes, geo.engram_slots, geo.engram_sub_dim, geo.num_engram_tables,
                       ENGRAM_TAPS, max(geo.engram_orders), len(geo.engram_orders), *orders,
                       len(geo.engram_layers), *sites, geo.rope_theta)
    cb = np.concatenate([codebook(b, GROUP) for b in CB_BITS]).astype("<f4")
    return head + cb.tobytes()


class _Blob(NamedTuple):
    name: str
    dtype: int
    shape: tuple[int, ...]
    data: bytes
    group: int = 0
    bits: int = 0


def _fp16(name: str, value: np.ndarray) -> _Blob:
    a = np.asarray(value, np.float16)  # upstream's np.asarray(arr, np.float16): round to nearest even
    return _Blob(name, FP16, a.shape, a.astype("<f2").tobytes())


def _cq(name: str, mat: np.ndarray, spec: Bits | tuple[BitsMap, Bits]) -> _Blob:
    bits = bits_for(name, *spec) if isinstance(spec, tuple) else spec
    idx, _, norm16 = cq_encode(np.asarray(mat, np.float32), bits, GROUP)
    data = pack_codes(idx, bits).tobytes() + norm16.astype("<f2").tobytes()
    return _Blob(name, CQ, tuple(mat.shape), data, GROUP, record_bits(bits))


def _blobs(flat: Mapping[str, np.ndarray], geo: Geometry, spec: Bits | tuple[BitsMap, Bits]) -> list[_Blob]:
    """Upstream's `_tensors`: every record in file order (kernels transposed to (out, in))."""
    L, n, N, S, s = geo.num_layers, geo.mhc_lanes, geo.num_engram_tables, geo.engram_slots, geo.engram_sub_dim
    out = [_cq("embedding", flat["embedding/embedding"], spec)]
    for i in range(L):
        for rec_name in LAYER_RECORDS:
            path, transposed = _LAYER_PATHS[rec_name]
            name, value = f"layer{i:02d}.{rec_name}", flat[path][i]
            if transposed:
                out.append(_cq(name, value.T, spec))  # (in, out) -> (out, in)
            else:
                out.append(_fp16(name, value.reshape(1) if rec_name == "attn_gate" else value))
    out += [_fp16(name, flat[f"stack/{name}"]) for name in MHC_FP16]
    for name in MHC_PHI:
        phi = flat[f"stack/{name}"]  # (L, n·D, m)
        out.append(_cq(name, phi.transpose(0, 2, 1).reshape(L * phi.shape[2], n * geo.d_model), spec))  # (L·m, n·D)
    for g in range(len(geo.engram_layers)):
        e = f"engrams_{g}"
        out += [_cq(f"engram{g}.tables", flat[f"{e}/embedding"].reshape(N * S, s), spec),  # (N·S, s)
                _cq(f"engram{g}.key_proj", flat[f"{e}/key_proj/kernel"].T, spec),  # (D, N·s)
                _cq(f"engram{g}.value_proj", flat[f"{e}/value_proj/kernel"].T, spec),  # (D, N·s)
                _fp16(f"engram{g}.taps", flat[f"{e}/taps"])]
    out.append(_fp16("final_norm", flat["stack/final_norm/scale"]))
    heads = [h for h in HEAD_CODES if f"{h}/probes" in flat]
    if heads:
        out.append(_fp16("heads.manifest", np.asarray([HEAD_CODES[h] for h in heads], np.float16)))
        for h in heads:
            kernel = flat[f"{h}/proj/kernel"].T  # (p·D, out) -> (out, p·D)
            bias = flat.get(f"{h}/proj/bias", np.zeros(kernel.shape[0], np.float16))  # contrastive: synthetic zeros
            out += [_fp16(f"{h}.probes", flat[f"{h}/probes"]), _fp16(f"{h}.proj", kernel), _fp16(f"{h}.bias", bias)]
    return out


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _pack(blobs: list[_Blob], geo: Geometry) -> bytes:
    """Upstream's `_pack_cact`: header and codebook, directory, then each blob at the next 64-byte boundary."""
    header = _header(geo, len(blobs))
    pos, offsets = len(header) + RECORD_SIZE * len(blobs), []
    for b in blobs:
        pos = _align(pos)
        offsets.append(pos)
        pos += len(b.data)
    directory = b"".join(struct.pack(RECORD_FMT, b.dtype, len(b.shape), 0, *(list(b.shape) + [0] * 4)[:4], off,
                                     len(b.data), b.group, b.bits) for b, off in zip(blobs, offsets, strict=True))
    buf = bytearray(header + directory)
    for b, off in zip(blobs, offsets, strict=True):
        buf += bytes(off - len(buf))  # zero gap up to the 64-byte boundary
        buf += b.data
    return bytes(buf)


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


# sentencepiece_model.proto: ModelProto.pieces = 1; SentencePiece {piece = 1, score = 2, type = 3};
# Type {NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6}, default NORMAL.
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


def _model_bytes(tokenizer: Any) -> bytes:
    if hasattr(tokenizer, "serialized_model_proto"):  # a loaded sentencepiece.SentencePieceProcessor
        return tokenizer.serialized_model_proto()
    if isinstance(tokenizer, (bytes, bytearray, memoryview)):
        return bytes(tokenizer)
    path = Path(tokenizer)
    if not path.is_file():
        raise TokenizerError(f"{path}: no such tokenizer file; give the SentencePiece .model file")
    return path.read_bytes()


def tokenizer_blob(tokenizer: Any) -> bytes:
    """Upstream's `_tokenizer_blob`: the RAW record for a SentencePiece model (a `.model` path, its bytes, or a
    loaded SentencePieceProcessor). Types: control 2, unknown 1, byte 4, a chat marker 3, anything else 0."""
    model = _model_bytes(tokenizer)
    try:
        pieces = spm_pieces(model)
    except (TokenizerError, UnicodeDecodeError, struct.error) as e:
        raise TokenizerError(f"not a readable SentencePiece model ({one_line(e)}); give the tokenizer's .model "
                             "file") from None
    if not pieces:
        raise TokenizerError("the SentencePiece model holds no pieces; give the tokenizer's .model file")
    markers = set(CHAT_MARKERS)
    out = bytearray(struct.pack(TOKENIZER_HEADER_FMT, len(pieces), PAD_ID, EOS_ID, BOS_ID, UNK_ID, 1, 1, 0))
    for piece, score, kind in pieces:
        if kind == _SP_CONTROL:
            t = TK_CONTROL
        elif kind == _SP_UNKNOWN:
            t = TK_UNKNOWN
        elif kind == _SP_BYTE:
            t = TK_BYTE
        elif piece in markers:  # upstream classifies markers by text, not by their USER_DEFINED type
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


# ----------------------------------------------------------------------------- lint


def lint(path: str | os.PathLike, bits_map: str | None = None) -> list[str]:
    """Every problem found in a `.cact` file, one line each (empty: fine).

    Checks the tag, the header against the directory (record count, sizes), every blob's place (inside the file,
    64-byte aligned, not overlapping, zero gaps), nbytes against dtype/shape/bits, the record bits against one
    bits map (`bits_map` if given, else the one the records imply), the shapes against the header's geometry,
    the header codebook, and the config the engine will build from the header.
    """
    try:
        scan = _scan(Path(path))
    except NeedleTwinError as e:
        return [str(e)]
    if scan.fatal:
        return scan.problems
    problems = list(scan.problems)
    h, records = scan.header, scan.records
    geo = Geometry.of_header(h)
    problems += _header_problems(h, scan.codebook)
    problems += _placement_problems(scan)
    problems += _record_field_problems(records)
    problems += _shape_problems(records, geo, scan.heads, scan.tokenizer)
    problems += _bits_problems(records, bits_map)
    problems += _value_problems(scan)
    if scan.tokenizer:
        rec = records[-1]
        try:
            with open(scan.path, "rb") as f:
                tok = parse_tokenizer_blob(_read_at(f, rec.offset, rec.nbytes))
            if len(tok["pieces"]) != h["vocab_size"]:
                problems.append(f"{rec.label()}: {len(tok['pieces'])} pieces but the header's vocab_size is "
                                f"{h['vocab_size']}")
        except (TokenizerError, CheckpointError, OSError) as e:
            problems.append(f"{rec.label()}: {one_line(e)}")
    if not problems:
        try:
            _config_from(CactFile(scan.path))
        except NeedleTwinError as e:
            problems.append(str(e))
    return problems


def _value_problems(scan: _Scan) -> list[str]:
    """Non-finite FP16 values and non-finite or negative CQ norms (what a damaged blob usually shows)."""
    out = []
    with open(scan.path, "rb") as f:
        for r in scan.records:
            if r.dtype == FP16:
                values = np.frombuffer(_read_at(f, r.offset, r.nbytes), "<f2")
            elif r.dtype == CQ:
                in_pad = padded(r.shape[1], r.group)
                n_norms = r.shape[0] * (in_pad // r.group)
                values = np.frombuffer(_read_at(f, r.offset + r.nbytes - 2 * n_norms, 2 * n_norms), "<f2")
                if np.any(values < 0):
                    out.append(f"{r.label()}: {int(np.sum(values < 0))} negative group norms")
            else:
                continue
            bad = int(np.count_nonzero(~np.isfinite(values)))
            if bad:
                what = "values" if r.dtype == FP16 else "group norms"
                out.append(f"{r.label()}: {bad} non-finite fp16 {what}")
    return out


def _header_problems(h: Mapping[str, Any], cb: np.ndarray) -> list[str]:
    out = []
    if h["codebook_len"] != CODEBOOK_LEN:
        out.append(f"header codebook_len {h['codebook_len']}, expected {CODEBOOK_LEN} (cb2|cb3|cb4)")
    else:
        fresh = np.concatenate([codebook(b, GROUP) for b in CB_BITS])
        if not np.array_equal(cb, fresh):
            worst = float(np.max(np.abs(cb.astype(np.float64) - fresh)))
            out.append(f"header codebook differs from upstream's Lloyd-Max codebooks by up to {worst:.3g}: the engine "
                       "decodes with the header's, upstream's reader with fresh ones; re-export the file")
    for what, count in (("engram orders", "num_engram_orders"), ("engram sites", "num_engram_sites")):
        if h[count] > MAX_SLOTS:
            out.append(f"header {count}={h[count]} but the header holds {MAX_SLOTS} {what}; the rest were dropped")
    for prefix, count in (("order", "num_engram_orders"), ("site", "num_engram_sites")):
        tail = [h[f"{prefix}{i}"] for i in range(min(h[count], MAX_SLOTS), MAX_SLOTS)]
        if any(tail):
            out.append(f"header {prefix}{MAX_SLOTS - len(tail)}..{prefix}3 = {tail} past {count}={h[count]} are not "
                       "zero")
    return out


def _placement_problems(scan: _Scan) -> list[str]:
    out = []
    records = sorted(scan.records, key=lambda r: r.offset)
    directory_end = HEADER_SIZE + 4 * scan.header["codebook_len"] + RECORD_SIZE * len(scan.records)
    if [r.index for r in records] != list(range(len(records))):
        out.append("blobs are not stored in record order")
    with open(scan.path, "rb") as f:
        pos = directory_end
        for r in records:
            if r.offset % ALIGN:
                out.append(f"{r.label()}: offset {r.offset} is not {ALIGN}-byte aligned (offset % {ALIGN} = "
                           f"{r.offset % ALIGN}); the engine maps blobs at aligned addresses")
            if r.offset < pos:
                out.append(f"{r.label()}: its blob at {r.offset} overlaps the one before it (which ends at {pos})")
            elif r.offset - pos >= ALIGN:
                out.append(f"{r.label()}: {r.offset - pos} bytes of gap before its blob (upstream pads < {ALIGN})")
            elif r.offset > pos and any(_read_at(f, pos, r.offset - pos)):
                out.append(f"{r.label()}: the {r.offset - pos}-byte gap before its blob is not zero")
            pos = max(pos, r.offset + r.nbytes)
    if pos != scan.size:
        out.append(f"{scan.size - pos} bytes after the last blob (upstream's file ends with it)")
    return out


def _record_field_problems(records: list[CactRecord]) -> list[str]:
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


def _shape_problems(records: list[CactRecord], geo: Geometry, heads: tuple[str, ...], tokenizer: bool) -> list[str]:
    head_width = {}
    for head in heads:
        proj = next((r for r in records if r.name == f"{head}.proj"), None)
        head_width[head] = proj.shape[0] if proj is not None and proj.ndim == 2 else -1
    if "confidence_head" in head_width:
        head_width["confidence_head"] = 1
    expected = expected_records(geo, head_width, tokenizer)
    out = []
    for r, (_, dtype, shape) in zip(records, expected, strict=True):
        if r.dtype != dtype or (dtype != RAW and r.shape != shape):
            out.append(f"{r.label()}: {DTYPE_NAMES.get(r.dtype, r.dtype)} {r.shape}, but the header's geometry "
                       f"gives {DTYPE_NAMES[dtype]} {shape}")
    return out


def _bits_problems(records: list[CactRecord], bits_map: str | None) -> list[str]:
    cq = [r for r in records if r.dtype == CQ]
    if bits_map is not None:
        parsed = parse_bits_map(bits_map)
        return [f"{r.label()}: {width_of_record(r.bits)} bits, but the bits map {bits_map!r} gives "
                f"{bits_for(r.name, *parsed)}" for r in cq if width_of_record(r.bits) != bits_for(r.name, *parsed)]
    if implied_bits_map(records) is not None:
        return []
    out = []
    by_name: dict[str, list[CactRecord]] = {}
    for r in cq:
        by_name.setdefault(canonical_name(r.name), []).append(r)
    for canon, recs in by_name.items():
        counts = Counter(width_of_record(r.bits) for r in recs)
        if len(counts) > 1:
            usual = counts.most_common(1)[0][0]
            odd = ", ".join(f"{r.name} has {width_of_record(r.bits)}" for r in recs if width_of_record(r.bits) != usual)
            out.append(f"{odd} bits but the other {canon} records have {usual}: no bits map gives one tensor "
                       "different widths in different layers")
    return out


def _geometry_problems(h: Mapping[str, Any], config: TransformerConfig) -> list[str]:
    """Header fields that contradict what the config they describe derives."""
    checks = (("hada_n", config.hada_dim), ("engram_sub_dim", config.engram_sub_dim),
              ("num_engram_tables", config.num_engram_tables), ("head_dim", config.head_dim),
              ("engram_conv_taps", ENGRAM_TAPS), ("engram_conv_dilation", config.engram_dilation))
    return [f"{k}={h[k]}, but the geometry it describes gives {want}" for k, want in checks if h[k] != want]
