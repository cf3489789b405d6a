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

import math
import os
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from convert import cact as container
from convert import plan
from convert.atomic import atomic_output

# The container's names this module's callers use (tests, parity_tests), kept importable from here.
from convert.cact import (  # noqa: F401
    CODEBOOK_LEN,
    CQ,
    DTYPE_NAMES,
    FP16,
    FP32,
    RAW,
    RECORD_FMT,
    RECORD_SIZE,
    CactRecord,
    packed_row_bytes,
    padded,
    parse_tokenizer_blob,
    spm_pieces,
)
from convert.cact import pack_codes as _pack_codes
from convert.errors import CheckpointError, ConfigError, NeedleTwinError, TokenizerError
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
from convert.v2.config import CHAT_MARKERS, ENGRAM_TAPS, TransformerConfig
from convert.v2.cq import GROUP, record_bits, width_of_record
from convert.v2.family import FAMILY
from convert.v2.mapping import CONFIDENCE_PROBES, CONTRASTIVE_PROBES

TAG = 0x05E12A83  # Needle 2's .cact, as upstream 2.0.3+ writes and the engine reads
OTHER_TAGS = {
    0x05E12A82: "an older exporter's file (cactus-needle <= 2.0.2 wrote 0x05E12A82 with a 5-field header that the "
                "engine does not read; upstream issue #58): re-export it with this tool or cactus-needle >= 2.0.3",
    0x05E12A84: "a Needle 3 file (tag 0x05E12A84); Needle 2 tools cannot read it",
}
HEADER_FMT = "<29If"
HEADER_SIZE = struct.calcsize(HEADER_FMT)  # 120
MAX_SLOTS = 4  # the header holds 4 engram orders and 4 sites
HEAD_CODES = {"contrastive_head": 1, "confidence_head": 2}  # upstream's manifest codes, in canonical order
HEAD_PROBES = {"contrastive_head": CONTRASTIVE_PROBES, "confidence_head": CONFIDENCE_PROBES}
HEAD_GROUP = {"contrastive_head": "contrastive", "confidence_head": "confidence"}
LOG_TEMP_INIT = math.log(0.07)  # upstream's contrastive_head/log_temp initialiser (not exported)

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


# ----------------------------------------------------------------------------- the container's Needle 2 layout


def _sites(h: Mapping[str, Any]) -> int:
    return min(h["num_engram_sites"], MAX_SLOTS)


LAYOUT = container.Layout(
    title="Needle 2", tag=TAG, other_tags=OTHER_TAGS, header_fmt=HEADER_FMT, header_fields=HEADER_FIELDS,
    cq_bits=(2, 3, 4, container.TERNARY_RECORD_BITS),
    model_count=lambda h: model_record_count(h["num_layers"], _sites(h)),
    model_names=lambda h: layout_names(h["num_layers"], _sites(h)),
    geometry_words=lambda h: f"L={h['num_layers']} layers and G={_sites(h)} engram sites",
    heads={code: (head, ("probes", "proj", "bias")) for head, code in HEAD_CODES.items()},
    head_counts=lambda extra: None if extra < 4 or (extra - 1) % 3 else (extra - 1) // 3,
    heads_words="1 + 3 per probe head",
    codes_words="each of 1 (contrastive) and 2 (confidence) at most once",
)


# ----------------------------------------------------------------------------- reading


class CactFile(container.CactFile):
    """A Needle 2 `.cact` opened for reading (`convert.cact.CactFile`), with the header as the engine reads it."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, LAYOUT)

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
    return head + container.header_codebook(GROUP).tobytes()


_Blob = container.Blob
_fp16 = container.fp16_blob


def _cq(name: str, mat: np.ndarray, spec: Bits | tuple[BitsMap, Bits]) -> _Blob:
    bits = bits_for(name, *spec) if isinstance(spec, tuple) else spec
    return container.cq_blob(name, mat, record_bits(bits), GROUP)


def pack_codes(idx: np.ndarray, bits: Bits) -> np.ndarray:
    """(R, Ip) indices -> packed rows at a Needle 2 width (2, 3, 4 or 1.58): `convert.cact.pack_codes`."""
    return _pack_codes(idx, record_bits(bits))



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


def _pack(blobs: list[_Blob], geo: Geometry) -> bytes:
    """Upstream's `_pack_cact`: header and codebook, directory, then each blob at the next 64-byte boundary."""
    return container.pack(_header(geo, len(blobs)), blobs)


# ----------------------------------------------------------------------------- tokenizer blob


def tokenizer_blob(tokenizer: Any) -> bytes:
    """Upstream's `_tokenizer_blob`: the RAW record for a SentencePiece model (a `.model` path, its bytes, or a
    loaded SentencePieceProcessor). Types: control 2, unknown 1, byte 4, a chat marker 3, anything else 0; Needle 2
    writes add_dummy_prefix 1."""
    return container.tokenizer_blob(tokenizer, CHAT_MARKERS, add_dummy_prefix=True)


# ----------------------------------------------------------------------------- lint


def lint(path: str | os.PathLike, bits_map: str | None = None) -> list[str]:
    """Every problem found in a `.cact` file, one line each (empty: fine).

    Checks the tag, the header against the directory (record count, sizes), every blob's place (inside the file,
    64-byte aligned, not overlapping, zero gaps), nbytes against dtype/shape/bits, the record bits against one
    bits map (`bits_map` if given, else the one the records imply), the shapes against the header's geometry,
    the header codebook, and the config the engine will build from the header.
    """
    scan, problems = container.lint_scan(path, LAYOUT)
    if scan is None:
        return problems
    h, records = scan.header, scan.records
    geo = Geometry.of_header(h)
    problems += container.codebook_problems(h, scan.codebook)
    problems += _header_problems(h)
    problems += container.placement_problems(scan)
    problems += container.record_field_problems(records)
    problems += _shape_problems(records, geo, scan.heads, scan.tokenizer)
    problems += _bits_problems(records, bits_map)
    problems += container.value_problems(scan)
    problems += container.tokenizer_problems(scan, h["vocab_size"], exact=True)
    if not problems:
        try:
            _config_from(CactFile(scan.path))
        except NeedleTwinError as e:
            problems.append(str(e))
    return problems


def _header_problems(h: Mapping[str, Any]) -> list[str]:
    out = []
    for what, count in (("engram orders", "num_engram_orders"), ("engram sites", "num_engram_sites")):
        if h[count] > MAX_SLOTS:
            out.append(f"header {count}={h[count]} but the header holds {MAX_SLOTS} {what}; the rest were dropped")
    for prefix, count in (("order", "num_engram_orders"), ("site", "num_engram_sites")):
        tail = [h[f"{prefix}{i}"] for i in range(min(h[count], MAX_SLOTS), MAX_SLOTS)]
        if any(tail):
            out.append(f"header {prefix}{MAX_SLOTS - len(tail)}..{prefix}3 = {tail} past {count}={h[count]} are not "
                       "zero")
    return out


def _shape_problems(records: list[CactRecord], geo: Geometry, heads: tuple[str, ...], tokenizer: bool) -> list[str]:
    head_width = {}
    for head in heads:
        proj = next((r for r in records if r.name == f"{head}.proj"), None)
        head_width[head] = proj.shape[0] if proj is not None and proj.ndim == 2 else -1
    if "confidence_head" in head_width:
        head_width["confidence_head"] = 1
    return container.shape_problems(records, expected_records(geo, head_width, tokenizer))


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
