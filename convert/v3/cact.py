"""Needle 3's `.cact` deployment file (NEEDLE_V3.md §7.3–7.4): its geometry and tensor order in the shared
container (`convert.cact`). Write it as upstream's `write_export` does, read it back as `read_export` does (and
into upstream's Flax tree), and lint it. numpy only.

Header `<48If`, 196 bytes: tag 0x05E12A84, num_tensors, codebook_len, kv_window, kv_bits, V, out_vocab, D, H, K, L,
hq, hv, max_seq_len, P, n, sliding_window, global mask lo/hi (bit i = layer i), τ, S, s, N, engram conv taps,
dilation, engram_seed_heads, |O|, O[4], G, sites[16], rope_theta (f32).

Order: embedding; per layer 27 records (24 when τ = 0); 6 mHC a/b; 3 φ; FP32 hada_p1, hada_p2; per engram site 4;
final_norm; the optional probe heads (manifest, then probes, gain, query, row_bias, proj, bias per head, the
router adding its calibration); the RAW tokenizer. Heads' probes/query/proj are CQ at 4 bits (an earlier layout
stored them FP16, probes as (L+1, k, D); both read).

Shape letters: V vocab, D d_model, H/K heads/kv heads, hq/hv head dims, L layers, τ conv taps, P Hadamard width
(a·b), n lanes, m = n or n² (φ rows per layer), N engram tables, S slots, s sub_dim, L1 = L+1, k probes, Q queries.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from convert import cact as container
from convert import plan
from convert.atomic import atomic_output
from convert.cact import CQ, FP16, FP32, RAW, TERNARY_RECORD_BITS, CactRecord
from convert.errors import CheckpointError, ConfigError, NeedleTwinError, TokenizerError
from convert.source import source_from_tree
from convert.trees import flatten_tree, unflatten_tree
from convert.v3.config import CHAT_MARKERS, ENGRAM_TAPS, HADA_COND_RANK, TransformerConfig, hada_blocks, hada_perms
from convert.v3.family import FAMILY
from convert.v3.ladder import rung

TAG = 0x05E12A84  # Needle 3's .cact (cactus-needle 3.x)
OTHER_TAGS = {
    0x05E12A83: "a Needle 2 file (tag 0x05E12A83); read it as Needle 2 (convert.v2.cact), not as Needle 3",
    0x05E12A82: "an older Needle 2 exporter's file (tag 0x05E12A82, cactus-needle <= 2.0.2); Needle 3 tools cannot "
                "read it",
}
HEADER_FMT = "<48If"
HEADER_SIZE = struct.calcsize(HEADER_FMT)  # 196
MAX_ORDERS, MAX_SITES, MAX_LAYERS = 4, 16, 64  # what the header holds (the global mask is two u32)
HEAD_BITS = 4  # upstream's quantize.HEAD_BITS: the heads' matrices, whatever the model's width
WIDTHS = (1, 2, 3, 4, 1.58)  # CQ widths: upstream's writer emits 4; the others follow its packing rules
HEAD_CODES = {"embedding_head": 1, "confidence_head": 2, "router_head": 3}  # manifest codes, canonical order
HEAD_RECORDS = ("probes", "gain", "query", "row_bias", "proj", "bias")
HEAD_OUT = {"confidence_head": 1, "router_head": 3}  # the embedding head's is embedding_dim (from its proj)
CALIBRATION_INIT = (0.90, 0.00, 0.60)  # upstream's RouterHead.calibration_init
LOG_TEMP_INIT, EMBEDDING_BIAS_INIT = math.log(10.0), -10.0  # the embedding head's scalars (not exported)

HEADER_FIELDS = (
    "tag", "num_tensors", "codebook_len", "kv_window", "kv_bits", "vocab_size", "out_vocab", "d_model", "num_heads",
    "num_kv_heads", "num_layers", "qk_head_dim", "v_head_dim", "max_seq_len", "hada_n", "mhc_lanes",
    "sliding_window", "global_mask_lo", "global_mask_hi", "qkv_conv_taps", "engram_slots", "engram_sub_dim",
    "num_engram_tables", "engram_conv_taps", "engram_conv_dilation", "engram_seed_heads", "num_engram_orders",
    *(f"order{i}" for i in range(MAX_ORDERS)), "num_engram_sites", *(f"site{i}" for i in range(MAX_SITES)),
    "rope_theta",
)
TAPS = ("q_taps", "k_taps", "v_taps")
MONARCH = ("d1", "d2", "b2", "d3", "d4", "w1a", "w1b", "w2a", "w2b", "w3a", "w3b", "cond_v", "cond_u")
MHC_FP16 = ("mhc_a_pre", "mhc_a_post", "mhc_a_res", "mhc_b_pre", "mhc_b_post", "mhc_b_res")
MHC_PHI = ("mhc_phi_pre", "mhc_phi_post", "mhc_phi_res")
PERMS = ("hada_p1", "hada_p2")
SITE_RECORDS = ("tables", "key_proj", "value_proj", "taps")

# Flax path of each per-layer record (stacked on axis 0 in the tree); True: a kernel stored transposed (out, in).
_BLOCK = "stack/layers/block"
_ATTN, _MLP = f"{_BLOCK}/self_attn", f"{_BLOCK}/hadamard_mlp"
_LAYER_PATHS = {
    "norm_in": (f"{_BLOCK}/ZCRMSNorm_0/scale", False), "q_proj": (f"{_ATTN}/q_proj/kernel", True),
    "k_proj": (f"{_ATTN}/k_proj/kernel", True), "v_proj": (f"{_ATTN}/v_proj/kernel", True),
    **{t: (f"{_ATTN}/{t}", False) for t in TAPS},
    "q_norm": (f"{_ATTN}/q_norm/scale", False), "k_norm": (f"{_ATTN}/k_norm/scale", False),
    "gate_proj": (f"{_ATTN}/gate_proj/kernel", True), "out_proj": (f"{_ATTN}/out_proj/kernel", True),
    "post_norm": (f"{_BLOCK}/post_attn_norm/scale", False), "attn_gate": (f"{_BLOCK}/attn_gate", False),
    "pre_hada": (f"{_BLOCK}/pre_hada_norm/scale", False), **{m: (f"{_MLP}/{m}", False) for m in MONARCH},
}


def layer_records(taps: bool) -> tuple[str, ...]:
    """One layer's 27 records (24 without the conv taps), in file order."""
    return ("norm_in", "q_proj", "k_proj", "v_proj", *(TAPS if taps else ()), "q_norm", "k_norm", "gate_proj",
            "out_proj", "post_norm", "attn_gate", "pre_hada", *MONARCH)


# ----------------------------------------------------------------------------- geometry and layout


class Geometry(NamedTuple):
    """What the header stores about the model (and what the positional layout follows from)."""

    kv_window: int
    kv_bits: int
    vocab_size: int
    out_vocab: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    num_layers: int
    qk_head_dim: int
    v_head_dim: int
    max_seq_len: int
    hada_n: int
    mhc_lanes: int
    sliding_window: int
    global_layers: tuple[int, ...]
    qkv_conv_taps: int
    engram_slots: int
    engram_sub_dim: int
    num_engram_tables: int
    engram_seed_heads: int
    engram_orders: tuple[int, ...]
    engram_layers: tuple[int, ...]
    rope_theta: float

    @classmethod
    def of_config(cls, config: TransformerConfig, kv_window: int) -> Geometry:
        hq, hv = config.head_dims
        return cls(kv_window, int(config.kv_bits or 8), config.vocab_size, int(config.out_vocab or 0),
                   config.d_model, config.num_heads, config.num_kv_heads, config.num_layers, hq, hv,
                   config.max_seq_len, config.hada_dim, config.mhc_lanes, int(config.sliding_window or 0),
                   tuple(config.global_layers), int(config.qkv_conv_taps or 0), config.engram_slots,
                   config.engram_sub_dim, config.num_engram_tables, int(config.engram_seed_heads or 0),
                   tuple(config.engram_orders), tuple(config.engram_layers), float(config.rope_theta))

    @classmethod
    def of_header(cls, h: Mapping[str, Any]) -> Geometry:
        mask = h["global_mask_lo"] | h["global_mask_hi"] << 32
        orders = tuple(h[f"order{i}"] for i in range(min(h["num_engram_orders"], MAX_ORDERS)))
        sites = tuple(h[f"site{i}"] for i in range(min(h["num_engram_sites"], MAX_SITES)))
        return cls(h["kv_window"], h["kv_bits"], h["vocab_size"], h["out_vocab"], h["d_model"], h["num_heads"],
                   h["num_kv_heads"], h["num_layers"], h["qk_head_dim"], h["v_head_dim"], h["max_seq_len"],
                   h["hada_n"], h["mhc_lanes"], h["sliding_window"],
                   tuple(i for i in range(min(h["num_layers"], MAX_LAYERS)) if mask >> i & 1), h["qkv_conv_taps"],
                   h["engram_slots"], h["engram_sub_dim"], h["num_engram_tables"], h["engram_seed_heads"], orders,
                   sites, float(h["rope_theta"]))


def model_record_count(num_layers: int, taps: bool, num_sites: int) -> int:
    """Records before the heads: 1 + (27 or 24)·L + 9 + 2 + 4·G + 1."""
    return (1 + len(layer_records(taps)) * num_layers + len(MHC_FP16) + len(MHC_PHI) + len(PERMS)
            + len(SITE_RECORDS) * num_sites + 1)


def layout_names(num_layers: int, taps: bool, num_sites: int, heads: tuple[str, ...] = (),
                 tokenizer: bool = False) -> list[str]:
    """Upstream's record names (`export._tensors`) in file order; `heads` in manifest order."""
    names = ["embedding"]
    names += [f"layer{i:02d}.{r}" for i in range(num_layers) for r in layer_records(taps)]
    names += [*MHC_FP16, *MHC_PHI, *PERMS]
    names += [f"engram{g}.{r}" for g in range(num_sites) for r in SITE_RECORDS]
    names.append("final_norm")
    if heads:
        names.append("heads.manifest")
        names += [f"{h}.{r}" for h in heads for r in _head_records(h)]
    if tokenizer:
        names.append("tokenizer")
    return names


def _head_records(head: str) -> tuple[str, ...]:
    return HEAD_RECORDS + (("calibration",) if head == "router_head" else ())


def expected_records(geo: Geometry, records: list[CactRecord], heads: tuple[str, ...],
                     tokenizer: bool) -> list[tuple[str, int, tuple]]:
    """(name, dtype, shape) of every record a file of this geometry holds. A head's probes/queries (k, Q) and
    output width are not in the header: they are taken from its gain, query and proj records, and a head stored in
    the earlier all-FP16 layout (probes FP16 (L1, k, D)) is expected as such."""
    V, D, H, K, L = geo.vocab_size, geo.d_model, geo.num_heads, geo.num_kv_heads, geo.num_layers
    hq, hv, tau, P, n = geo.qk_head_dim, geo.v_head_dim, geo.qkv_conv_taps, geo.hada_n, geo.mhc_lanes
    N, S, s = geo.num_engram_tables, geo.engram_slots, geo.engram_sub_dim
    a, b = hada_blocks(P) if P > 0 else (0, 0)
    layer = {"norm_in": (FP16, (D,)), "q_proj": (CQ, (H * hq, D)), "k_proj": (CQ, (K * hq, D)),
             "v_proj": (CQ, (K * hv, D)), "q_taps": (FP16, (tau, H * hq)), "k_taps": (FP16, (tau, K * hq)),
             "v_taps": (FP16, (tau, K * hv)), "q_norm": (FP16, (hq,)), "k_norm": (FP16, (hq,)),
             "gate_proj": (CQ, (H * hv, D)), "out_proj": (CQ, (D, H * hv)), "post_norm": (FP16, (D,)),
             "attn_gate": (FP16, (1,)), "pre_hada": (FP16, (D,)),
             **{d: (FP16, (P,)) for d in ("d1", "d2", "b2", "d3", "d4")},
             **{f"w{k}{side}": (FP16, (m, m)) for k in (1, 2, 3) for side, m in (("a", a), ("b", b))},
             "cond_v": (FP16, (D, HADA_COND_RANK)), "cond_u": (FP16, (HADA_COND_RANK, P))}
    out = [("embedding", CQ, (V, D))]
    out += [(f"layer{i:02d}.{r}", *layer[r]) for i in range(L) for r in layer_records(tau > 0)]
    out += [("mhc_a_pre", FP16, (L,)), ("mhc_a_post", FP16, (L,)), ("mhc_a_res", FP16, (L,)),
            ("mhc_b_pre", FP16, (L, n)), ("mhc_b_post", FP16, (L, n)), ("mhc_b_res", FP16, (L, n, n)),
            ("mhc_phi_pre", CQ, (L * n, n * D)), ("mhc_phi_post", CQ, (L * n, n * D)),
            ("mhc_phi_res", CQ, (L * n * n, n * D)), ("hada_p1", FP32, (P,)), ("hada_p2", FP32, (P,))]
    for g in range(len(geo.engram_layers)):
        out += [(f"engram{g}.tables", CQ, (N * S, s)), (f"engram{g}.key_proj", CQ, (D, N * s)),
                (f"engram{g}.value_proj", CQ, (D, N * s)), (f"engram{g}.taps", FP16, (ENGRAM_TAPS, D))]
    out.append(("final_norm", FP16, (D,)))
    if heads:
        by_name = {r.name: r for r in records}
        out.append(("heads.manifest", FP16, (len(heads),)))
        for head in heads:
            gain, query, proj = (by_name[f"{head}.{r}"] for r in ("gain", "query", "proj"))
            k = gain.shape[1] if gain.ndim == 2 else -1
            q = query.shape[0] if query.ndim == 2 else -1
            width = HEAD_OUT.get(head, proj.shape[0] if proj.ndim == 2 else -1)
            legacy = by_name[f"{head}.probes"].dtype == FP16
            matrix = FP16 if legacy else CQ
            out += [(f"{head}.probes", matrix, (L + 1, k, D) if legacy else ((L + 1) * k, D)),
                    (f"{head}.gain", FP16, (L + 1, k)), (f"{head}.query", matrix, (q, D)),
                    (f"{head}.row_bias", FP16, (q, L + 1, k)), (f"{head}.proj", matrix, (width, q * D)),
                    (f"{head}.bias", FP16, (width,))]
            if head == "router_head":
                out.append(("router_head.calibration", FP16, (3,)))
    if tokenizer:
        out.append(("tokenizer", RAW, ()))
    return out


def _sites(h: Mapping[str, Any]) -> int:
    return min(h["num_engram_sites"], MAX_SITES)


def _head_counts(extra: int) -> int | None:
    """Heads after the model records: a manifest, then 6 records per head (7 for the router)."""
    if extra < 1 + len(HEAD_RECORDS) or (extra - 1) % len(HEAD_RECORDS) > 1:
        return None
    return (extra - 1) // len(HEAD_RECORDS)


LAYOUT = container.Layout(
    title="Needle 3", tag=TAG, other_tags=OTHER_TAGS, header_fmt=HEADER_FMT, header_fields=HEADER_FIELDS,
    cq_bits=(1, 2, 3, 4, TERNARY_RECORD_BITS),
    model_count=lambda h: model_record_count(h["num_layers"], h["qkv_conv_taps"] > 0, _sites(h)),
    model_names=lambda h: layout_names(h["num_layers"], h["qkv_conv_taps"] > 0, _sites(h)),
    geometry_words=lambda h: (f"L={h['num_layers']} layers, qkv_conv_taps={h['qkv_conv_taps']} and "
                              f"G={_sites(h)} engram sites"),
    heads={code: (head, _head_records(head)) for head, code in HEAD_CODES.items()},
    head_counts=_head_counts,
    heads_words="the heads manifest and 6 records per probe head (7 for the router)",
    codes_words="each of 1 (embedding), 2 (confidence) and 3 (router) at most once",
)


# ----------------------------------------------------------------------------- reading


class CactFile(container.CactFile):
    """A Needle 3 `.cact` opened for reading (`convert.cact.CactFile`), with the header as upstream reads it."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(path, LAYOUT)

    @property
    def geometry(self) -> Geometry:
        return Geometry.of_header(self.header)

    @property
    def info(self) -> dict[str, Any]:
        """Upstream's `read_export` info dict (same keys, same order): global layers decoded, orders and sites cut
        to their counts."""
        h, geo = self.header, self.geometry
        out = {"num_tensors": h["num_tensors"], "codebook": self.codebook.copy(), "kv_window": h["kv_window"],
               "kv_bits": h["kv_bits"]}
        out.update({k: h[k] for k in HEADER_FIELDS[5:26] if not k.startswith("global_mask")})
        out.update(global_layers=geo.global_layers, engram_orders=geo.engram_orders,
                   engram_layers=geo.engram_layers, rope_theta=h["rope_theta"])
        return out

    @property
    def config(self) -> TransformerConfig:
        return _config_from(self)


def read_cact(path: str | os.PathLike) -> CactFile:
    """Open a Needle 3 `.cact` file (one CheckpointError line if it is damaged or not one)."""
    return CactFile(path)


def read_export(path: str | os.PathLike) -> tuple[dict[str, Any], list[np.ndarray | bytes]]:
    """Upstream's `read_export(path)` -> (info, tensors)."""
    cact = CactFile(path)
    return cact.info, cact.tensors()


# ----------------------------------------------------------------------------- the config the header gives

# Config fields no header stores: upstream's class defaults stand in for them.
NOT_STORED = ("pad_token_id", "dtype", "flash", "ladder_depths", "ladder_sample", "ladder_widths", "ladder_order",
              "act_bits", "weight_bits", "remat", "scan_unroll")


def _config_from(cact: CactFile) -> TransformerConfig:
    """The TransformerConfig the header (and the heads' records) describe; fields not stored take the class
    defaults (`NOT_STORED`); kv_window is 0 when the header holds the budget window (what a build writes)."""
    geo, h = cact.geometry, cact.header
    orders = geo.engram_orders
    kwargs: dict[str, Any] = {
        "vocab_size": geo.vocab_size, "d_model": geo.d_model, "num_heads": geo.num_heads,
        "num_kv_heads": geo.num_kv_heads, "num_layers": geo.num_layers, "qk_head_dim": geo.qk_head_dim,
        "v_head_dim": geo.v_head_dim, "max_seq_len": geo.max_seq_len, "rope_theta": geo.rope_theta,
        "engram_orders": orders, "engram_slots": geo.engram_slots, "engram_seed_heads": geo.engram_seed_heads,
        "engram_layers": geo.engram_layers, "global_layers": geo.global_layers,
        "sliding_window": geo.sliding_window, "mhc_lanes": geo.mhc_lanes, "qkv_conv_taps": geo.qkv_conv_taps,
        "out_vocab": geo.out_vocab, "kv_bits": geo.kv_bits,
    }
    for head in cact.heads:
        name = head.removesuffix("_head")
        kwargs[f"{name}_probes"] = cact.record(f"{head}.gain").shape[-1]
        kwargs[f"{name}_queries"] = cact.record(f"{head}.query").shape[0]
        if head == "embedding_head":
            kwargs["embedding_dim"] = cact.record(f"{head}.proj").shape[0]
    if orders and geo.num_engram_tables % len(orders) == 0:
        heads = geo.num_engram_tables // len(orders)
        kwargs["engram_heads"] = 0 if heads == max(1, geo.d_model // (len(orders) * 128)) else heads
    try:
        config = TransformerConfig(**kwargs)
        config.check()
        if geo.kv_window not in (0, config.kv_budget_window):  # 0: "size it from the budget", as upstream's default
            config = config.replace(kv_window=geo.kv_window)
    except ConfigError as e:
        raise CheckpointError(f"{cact.path}: the header describes no valid Needle 3 config ({e}); the header is "
                              "damaged") from None
    problems = _geometry_problems(h, config)
    if problems:
        raise CheckpointError(f"{cact.path}: header: {problems[0]}")
    return config


def _geometry_problems(h: Mapping[str, Any], config: TransformerConfig) -> list[str]:
    """Header fields that contradict what the config they describe derives."""
    hq, hv = config.head_dims
    checks = (("hada_n", config.hada_dim), ("engram_sub_dim", config.engram_sub_dim),
              ("num_engram_tables", config.num_engram_tables), ("qk_head_dim", hq), ("v_head_dim", hv),
              ("engram_conv_taps", ENGRAM_TAPS), ("engram_conv_dilation", config.engram_dilation))
    return [f"{k}={h[k]}, but the geometry it describes gives {want}" for k, want in checks if h[k] != want]


# ----------------------------------------------------------------------------- back to the Flax tree


class CactParams(NamedTuple):
    params: dict[str, Any]  # the Needle 3 Flax tree, float32 leaves (exactly what read_export's tensors map to)
    config: TransformerConfig
    constants: dict[str, np.ndarray]  # records with no leaf: hada_p1/p2, heads.manifest, embedding_head.bias, ...
    notes: tuple[str, ...]  # what is lossy or left out

    def lines(self) -> list[str]:
        return list(self.notes)


def to_params(cact: CactFile | str | os.PathLike) -> CactParams:
    """The Needle 3 Flax tree a `.cact` holds (upstream's `read_export` tensors with `_tensors`' layout undone:
    kernels back to (in, out), φ to (L, n·D, m), tables to (N, S, s), probes to (L1, k, D)), the config its header
    gives, and the records that have no leaf. The router's calibration becomes `router_head/calibration` only when
    it is not the fp16 of upstream's default (what an export without that leaf writes)."""
    if not isinstance(cact, CactFile):
        cact = CactFile(cact)
    config = cact.config
    problems = container.shape_problems(cact.records, expected_records(cact.geometry, cact.records, cact.heads,
                                                                       cact.has_tokenizer))
    if problems:
        raise CheckpointError(f"{cact.path}: {problems[0]}" + (f" (and {len(problems) - 1} more: run lint)"
                                                                if len(problems) > 1 else ""))
    geo = cact.geometry
    L, N, S, s = geo.num_layers, geo.num_engram_tables, geo.engram_slots, geo.engram_sub_dim
    t = cact.tensor
    flat: dict[str, np.ndarray] = {"embedding/embedding": t("embedding")}
    for rec_name in layer_records(geo.qkv_conv_taps > 0):
        path, transposed = _LAYER_PATHS[rec_name]
        per_layer = [t(f"layer{i:02d}.{rec_name}") for i in range(L)]
        if transposed:
            per_layer = [w.T for w in per_layer]  # (out, in) -> (in, out)
        stacked = np.stack(per_layer) if per_layer else np.zeros((0,), np.float32)  # (L, ...)
        flat[path] = stacked.reshape(L) if rec_name == "attn_gate" else stacked  # (L, 1) -> (L,)
    for name in MHC_FP16:
        flat[f"stack/{name}"] = t(name)
    for name in MHC_PHI:
        phi = t(name)  # (L·m, n·D)
        flat[f"stack/{name}"] = np.ascontiguousarray(phi.reshape(L, -1, phi.shape[1]).transpose(0, 2, 1))  # (L,nD,m)
    constants = {name: t(name) for name in PERMS}
    for g in range(len(geo.engram_layers)):
        flat[f"engrams_{g}/embedding"] = t(f"engram{g}.tables").reshape(N, S, s)  # (N·S, s) -> (N, S, s)
        flat[f"engrams_{g}/key_proj/kernel"] = np.ascontiguousarray(t(f"engram{g}.key_proj").T)  # (N·s, D)
        flat[f"engrams_{g}/value_proj/kernel"] = np.ascontiguousarray(t(f"engram{g}.value_proj").T)  # (N·s, D)
        flat[f"engrams_{g}/taps"] = t(f"engram{g}.taps")
    flat["stack/final_norm/scale"] = t("final_norm")
    notes = ["CQ records are dequantised reconstructions; FP16 records were rounded to fp16 by the export"]
    if cact.heads:
        constants["heads.manifest"] = t("heads.manifest")
    for head in cact.heads:
        gain = t(f"{head}.gain")  # (L1, k)
        flat[f"{head}/probes"] = t(f"{head}.probes").reshape(gain.shape[0], gain.shape[1], -1)  # (L1, k, D)
        flat[f"{head}/gain"] = gain
        flat[f"{head}/query"] = t(f"{head}.query")
        flat[f"{head}/row_bias"] = t(f"{head}.row_bias")
        flat[f"{head}/proj/kernel"] = np.ascontiguousarray(t(f"{head}.proj").T)  # (out, Q·D) -> (Q·D, out)
        bias = t(f"{head}.bias")
        if head == "embedding_head":
            if np.any(bias != 0):
                raise CheckpointError(f"{cact.path}: embedding_head.bias is not zero; upstream's embedding head has no "
                                      "projection bias and its exporter writes zeros, so this file was not written "
                                      "by it and its head cannot be put into a Needle 3 tree")
            constants["embedding_head.bias"] = bias
        else:
            flat[f"{head}/proj/bias"] = bias
    if "router_head" in cact.heads:
        calibration = t("router_head.calibration")
        constants["router_head.calibration"] = calibration
        if not np.array_equal(calibration, np.asarray(CALIBRATION_INIT, np.float16).astype(np.float32)):
            flat["router_head/calibration"] = calibration
    split = _perms_split(constants, geo.hada_n, cact.path)
    if split:
        notes.append("the Hadamard permutations are split by halves: the model was built with ladder_widths, which "
                     "the header does not store (config.ladder_widths is left empty)")
    if "embedding_head" in cact.heads:
        notes.append("embedding_head/log_temp and embedding_head/bias are not exported")
    notes.append(f"config fields not stored (class defaults): {', '.join(NOT_STORED)}")
    return CactParams(unflatten_tree(flat), config, constants, tuple(notes))


def _perms_split(constants: Mapping[str, np.ndarray], P: int, path: Path) -> bool:
    """Whether the FP32 permutation records are upstream's split ones; neither layout is a damaged file."""
    stored = [constants[name] for name in PERMS]
    for split in (False, True):
        if all(np.array_equal(a, b.astype(np.float32)) for a, b in zip(stored, hada_perms(P, split), strict=True)):
            return split
    raise CheckpointError(f"{path}: hada_p1/hada_p2 are not upstream's Hadamard permutations of {P} (seeds 11 and "
                          "13, whole or split by halves); the file is damaged, re-export it")


# ----------------------------------------------------------------------------- writing


def write_cact(params: Mapping[str, Any], config: TransformerConfig, path: str | os.PathLike, bits: float = 4,
               group: int = container.GROUP, tokenizer: Any = None, kv_window: int | None = None,
               layers: int | None = None, *, force: bool = False) -> dict[str, Any]:
    """Write the `.cact` upstream's `write_export(params, config, path, bits, group, tokenizer, kv_window)` writes,
    byte for byte; returns upstream's {"path", "bytes", "tensors"}.

    bits: 4 is upstream's writer (its `_cq_pack` takes nothing else; the heads are 4-bit whatever bits is);
    1, 2, 3 and 1.58 (ternary) follow upstream's packing rules and reader but go beyond its own writer.
    kv_window: the header's window (default: config.effective_kv_window, what `needle build` writes).
    tokenizer: a SentencePiece `.model` (path, bytes or a loaded processor) for the RAW record. layers: write
    ladder rung `layers` (`needle build --layers`). Written atomically; never over a file unless force.
    """
    with atomic_output(Path(path), force=force) as tmp:  # checks the target before any work
        buf = build_cact(params, config, bits, group, tokenizer, kv_window, layers)
        with open(tmp, "wb") as f:
            f.write(buf)
    return {"path": str(path), "bytes": len(buf), "tensors": struct.unpack_from("<I", buf, 4)[0]}


def build_cact(params: Mapping[str, Any], config: TransformerConfig, bits: float = 4, group: int = container.GROUP,
               tokenizer: Any = None, kv_window: int | None = None, layers: int | None = None) -> bytes:
    """The bytes write_cact writes (upstream's `_pack_cact`), without touching the disk."""
    if not isinstance(config, TransformerConfig):
        raise ConfigError(f"a Needle 3 .cact needs a convert.v3.TransformerConfig, got {type(config).__name__}")
    rec_bits = record_bits(bits)
    if not container.valid_group(group):
        raise ConfigError(f"group={group} is not a power of two in 8..{container.MAX_GROUP}; upstream uses 128")
    if layers is not None:
        params, config = rung(params, config, layers)
    window = config.effective_kv_window if kv_window is None else int(kv_window)
    geo = Geometry.of_config(config, window)
    _check_representable(geo)
    tok_blob = None
    if tokenizer is not None:
        tok_blob = container.tokenizer_blob(tokenizer, CHAT_MARKERS)
        pieces = struct.unpack_from("<I", tok_blob)[0]
        if pieces > config.vocab_size:  # upstream refuses this too
            raise TokenizerError(f"the tokenizer has {pieces} pieces but config.vocab_size is {config.vocab_size}; "
                                 "give the tokenizer this model was trained with")
    plan.check_names(source_from_tree(params), FAMILY, config, "params")
    flat = {k: np.asarray(v) for k, v in flatten_tree(params).items()}
    blobs = _blobs(flat, config, geo, rec_bits, group)
    if tok_blob is not None:
        blobs.append(container.Blob("tokenizer", RAW, (), tok_blob))
    return container.pack(_header(geo, len(blobs), group), blobs)


def record_bits(bits: float) -> int:
    """The record `bits` field of a width: 1, 2, 3, 4, or 5 for ternary (1.58)."""
    if isinstance(bits, bool) or bits not in WIDTHS:
        raise ConfigError(f"bits={bits!r} is not a CQ width; use 4 (upstream's writer), or 1, 2, 3 or 1.58 "
                          "(ternary)")
    return TERNARY_RECORD_BITS if bits == 1.58 else int(bits)


def _check_representable(geo: Geometry) -> None:
    """What upstream's exporter raises on (L > 64, G > 16), and what it would write wrong (|O| > 4: dropped)."""
    if geo.num_layers > MAX_LAYERS:
        raise ConfigError(f"config.num_layers={geo.num_layers}: a .cact header's global-layer mask holds "
                          f"{MAX_LAYERS} layers; use at most {MAX_LAYERS}")
    for what, values, most in (("engram_orders", geo.engram_orders, MAX_ORDERS),
                               ("engram_layers", geo.engram_layers, MAX_SITES)):
        if len(values) > most:
            raise ConfigError(f"config.{what}={list(values)} has {len(values)} entries; a .cact header holds {most}; "
                              f"use at most {most}")
    bad = {k: v for k, v in geo._asdict().items() if isinstance(v, int) and not 0 <= v < 2**32}
    if bad:
        k, v = next(iter(bad.items()))
        raise ConfigError(f"{k}={v} does not fit the .cact header's unsigned 32-bit field; use 0 <= {k} < 2**32")


def _header(geo: Geometry, num_tensors: int, group: int) -> bytes:
    mask = 0
    for layer in geo.global_layers:
        mask |= 1 << int(layer)
    orders = (list(geo.engram_orders) + [0] * MAX_ORDERS)[:MAX_ORDERS]
    sites = (list(geo.engram_layers) + [0] * MAX_SITES)[:MAX_SITES]
    head = struct.pack(HEADER_FMT, TAG, num_tensors, container.CODEBOOK_LEN, geo.kv_window, geo.kv_bits,
                       geo.vocab_size, geo.out_vocab, geo.d_model, geo.num_heads, geo.num_kv_heads, geo.num_layers,
                       geo.qk_head_dim, geo.v_head_dim, geo.max_seq_len, geo.hada_n, geo.mhc_lanes,
                       geo.sliding_window, mask & 0xFFFFFFFF, mask >> 32 & 0xFFFFFFFF, geo.qkv_conv_taps,
                       geo.engram_slots, geo.engram_sub_dim, geo.num_engram_tables, ENGRAM_TAPS,
                       max(geo.engram_orders), geo.engram_seed_heads, len(geo.engram_orders), *orders,
                       len(geo.engram_layers), *sites, geo.rope_theta)
    return head + container.header_codebook(group).tobytes()


def _blobs(flat: Mapping[str, np.ndarray], config: TransformerConfig, geo: Geometry, rec_bits: int,
           group: int) -> list[container.Blob]:
    """Upstream's `_tensors`: every record in file order (kernels transposed to (out, in))."""
    L, N, S, s = geo.num_layers, geo.num_engram_tables, geo.engram_slots, geo.engram_sub_dim

    def cq(name: str, mat: np.ndarray, width: int = rec_bits) -> container.Blob:
        return container.cq_blob(name, mat, width, group)

    fp16 = container.fp16_blob
    out = [cq("embedding", flat["embedding/embedding"])]
    for i in range(L):
        for rec_name in layer_records(geo.qkv_conv_taps > 0):
            path, transposed = _LAYER_PATHS[rec_name]
            name, value = f"layer{i:02d}.{rec_name}", flat[path][i]
            if transposed:
                out.append(cq(name, value.T))  # (in, out) -> (out, in)
            else:
                out.append(fp16(name, value.reshape(1) if rec_name == "attn_gate" else value))
    out += [fp16(name, flat[f"stack/{name}"]) for name in MHC_FP16]
    for name in MHC_PHI:
        phi = flat[f"stack/{name}"]  # (L, n·D, m)
        out.append(cq(name, phi.transpose(0, 2, 1).reshape(L * phi.shape[2], phi.shape[1])))  # (L·m, n·D)
    for name, perm in zip(PERMS, hada_perms(geo.hada_n, bool(config.ladder_widths)), strict=True):
        out.append(container.fp32_blob(name, perm))  # the permutation indices as floats
    for g in range(len(geo.engram_layers)):
        e = f"engrams_{g}"
        out += [cq(f"engram{g}.tables", flat[f"{e}/embedding"].reshape(N * S, s)),  # (N·S, s)
                cq(f"engram{g}.key_proj", flat[f"{e}/key_proj/kernel"].T),  # (D, N·s)
                cq(f"engram{g}.value_proj", flat[f"{e}/value_proj/kernel"].T),  # (D, N·s)
                fp16(f"engram{g}.taps", flat[f"{e}/taps"])]
    out.append(fp16("final_norm", flat["stack/final_norm/scale"]))
    heads = [h for h in HEAD_CODES if f"{h}/probes" in flat]
    if heads:
        out.append(fp16("heads.manifest", np.asarray([HEAD_CODES[h] for h in heads], np.float16)))
    for h in heads:
        kernel = flat[f"{h}/proj/kernel"].T  # (Q·D, out) -> (out, Q·D)
        bias = flat.get(f"{h}/proj/bias", np.zeros(kernel.shape[0], np.float16))  # embedding head: zeros
        probes = flat[f"{h}/probes"]  # (L1, k, D)
        out += [cq(f"{h}.probes", probes.reshape(-1, probes.shape[-1]), HEAD_BITS),  # (L1·k, D)
                fp16(f"{h}.gain", flat[f"{h}/gain"]), cq(f"{h}.query", flat[f"{h}/query"], HEAD_BITS),
                fp16(f"{h}.row_bias", flat[f"{h}/row_bias"]), cq(f"{h}.proj", kernel, HEAD_BITS),
                fp16(f"{h}.bias", bias)]
        if h == "router_head":
            calibration = flat.get("router_head/calibration", CALIBRATION_INIT)
            out.append(fp16("router_head.calibration", np.asarray(calibration, np.float16)))
    return out


# ----------------------------------------------------------------------------- tokenizer blob and lint


def tokenizer_blob(tokenizer: Any) -> bytes:
    """Upstream's Needle 3 `_tokenizer_blob`: all 16 chat markers USER_DEFINED, add_dummy_prefix measured."""
    return container.tokenizer_blob(tokenizer, CHAT_MARKERS)


def lint(path: str | os.PathLike) -> list[str]:
    """Every problem found in a Needle 3 `.cact` file, one line each (empty: fine).

    Checks the tag, the header against the directory (record count for the geometry, sizes), every blob's place
    (inside the file, 64-byte aligned, not overlapping, zero gaps), nbytes against dtype/shape/bits, each record's
    dtype and shape against the order the header's geometry implies, the header's own fields (codebook, unused
    slots, global layers past L), the permutation records, the tokenizer, and the config the header describes.
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
    problems += container.shape_problems(records, expected_records(geo, records, scan.heads, scan.tokenizer))
    problems += container.value_problems(scan)
    problems += container.tokenizer_problems(scan, h["vocab_size"], exact=False)
    if not problems:
        try:
            to_params(CactFile(scan.path))
        except NeedleTwinError as e:
            problems.append(str(e))
    return problems


def _header_problems(h: Mapping[str, Any]) -> list[str]:
    out = []
    for what, count, most in (("engram orders", "num_engram_orders", MAX_ORDERS),
                              ("engram sites", "num_engram_sites", MAX_SITES)):
        if h[count] > most:
            out.append(f"header {count}={h[count]} but the header holds {most} {what}; the rest were dropped")
    for prefix, count, most in (("order", "num_engram_orders", MAX_ORDERS), ("site", "num_engram_sites", MAX_SITES)):
        tail = [h[f"{prefix}{i}"] for i in range(min(h[count], most), most)]
        if any(tail):
            out.append(f"header {prefix}{most - len(tail)}..{prefix}{most - 1} = {tail} past {count}={h[count]} are "
                       "not zero")
    mask = h["global_mask_lo"] | h["global_mask_hi"] << 32
    past = [i for i in range(64) if mask >> i & 1 and i >= h["num_layers"]]
    if past:
        out.append(f"header global mask marks layer(s) {past} past num_layers={h['num_layers']}")
    if h["out_vocab"] > h["vocab_size"]:
        out.append(f"header out_vocab={h['out_vocab']} exceeds vocab_size={h['vocab_size']}")
    return out


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """What `needle-twin inspect` adds for a Needle 3 `.cact`: every lint problem and, when the file reads, every
    header field by name, the config it describes and each record."""
    out: dict[str, Any] = {"lint": lint(path)}
    try:
        f = CactFile(path)
    except NeedleTwinError:
        return out  # lint has said why
    header: dict[str, Any] = {k: (f"0x{v:08X}" if k == "tag" else v) for k, v in f.header.items()}
    header["global_layers"] = list(f.geometry.global_layers)
    widths = sorted({r.bits for r in f.records if r.dtype == CQ})
    out.update(engine_config=header, records=len(f), record_table=[r.describe() for r in f.records],
               bits=", ".join("1.58" if b == TERNARY_RECORD_BITS else str(b) for b in widths) or "none",
               tokenizer=f.has_tokenizer, heads=list(f.heads))
    return out
