"""Needle 2's `.cact` file: writer, reader, to_params and lint against upstream's own files and goldens.

Goldens (tests/data/README-cact.md): the five `needle-v2-tiny.*.cact` files written by upstream's
`write_export` from `needle-v2-tiny.pkl` (arguments in `meta_json`), `quant.V.read.npz` (every
tensor upstream's `read_export` returns) and `quant.npz` (records, names, info, tokenizer blob).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch

from convert.atomic import OutputExistsError
from convert.errors import CheckpointError, ConfigError, NeedleTwinError, TokenizerError
from convert.io import read_checkpoint
from convert.mapping import flax_to_torch, random_flax_params
from convert.trees import flatten_tree, unflatten_tree
from convert.v2 import cact
from convert.v2.bits import bits_for, parse_bits_map
from convert.v2.config import TransformerConfig
from convert.v2.cq import cq_mixed_params

torch.set_float32_matmul_precision("highest")  # house rule; nothing here multiplies in torch

DATA = Path(__file__).resolve().parents[1] / "data"
QUANT = np.load(DATA / "needle-v2-tiny.quant.npz")
META = json.loads(str(QUANT["meta_json"]))
VARIANTS = ("q4", "q2", "mixed", "t158", "q4tok")
READ_VARIANTS = ("q4", "q2", "mixed", "t158")  # q4tok has no .read.npz: its tensors 0-95 are q4's
SPM = DATA / "needle-v2-tiny.spm.model"
READ_TOL = 1e-6  # README-cact "Tolerances": float32 rounding of (cb[idx]·norm16) @ H_128 (~1e-7 here)
DIR0 = cact.HEADER_SIZE + 4 * cact.CODEBOOK_LEN  # where the directory starts: 232


def cact_path(variant: str) -> Path:
    return DATA / f"needle-v2-tiny.{variant}.cact"


@pytest.fixture(scope="module")
def checkpoint():
    return read_checkpoint(DATA / "needle-v2-tiny.pkl")


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize("variant", VARIANTS)
def test_records_names_and_info_are_upstreams(variant):
    f = cact.read_cact(cact_path(variant))
    np.testing.assert_array_equal(np.array([r.row() for r in f.records]), QUANT[f"{variant}/records"])
    assert f.names == json.loads(str(QUANT[f"{variant}/names_json"]))
    info = f.info
    assert list(info) == list(json.loads(str(QUANT[f"{variant}/info_json"])))  # same keys, same order
    info = {**info, "codebook": info["codebook"].tolist(), "engram_orders": list(info["engram_orders"]),
            "engram_layers": list(info["engram_layers"])}
    assert info == json.loads(str(QUANT[f"{variant}/info_json"]))
    assert f.heads == ("contrastive_head", "confidence_head") and f.has_tokenizer == (variant == "q4tok")


@pytest.mark.parametrize("variant", READ_VARIANTS)
def test_tensors_are_upstreams_read_export(variant):
    golden = np.load(DATA / f"needle-v2-tiny.quant.{variant}.read.npz")
    info, tensors = cact.read_export(cact_path(variant))
    assert len(tensors) == info["num_tensors"] == 96
    records = cact.read_cact(cact_path(variant)).records
    worst = 0.0
    for rec, t in zip(records, tensors, strict=True):
        want = golden[f"t{rec.index:03d}"]
        assert t.dtype == np.float32 and t.shape == want.shape, rec.name
        if rec.dtype == cact.FP16:
            np.testing.assert_array_equal(t, want, err_msg=rec.name)  # fp16 widened: exact
        else:
            worst = max(worst, float(np.max(np.abs(t - want))))
    assert worst <= READ_TOL, f"{variant}: CQ records max |Δ| {worst:.3g}"


def test_q4tok_is_q4_plus_the_tokenizer():
    q4, tok = cact.read_cact(cact_path("q4")), cact.read_cact(cact_path("q4tok"))
    for i in range(len(q4)):
        assert q4.blob(i) == tok.blob(i), q4.names[i]
    blob = tok.tensor("tokenizer")
    assert isinstance(blob, bytes) and blob == QUANT["q4tok/tokenizer_blob"].tobytes()


def test_codes_and_norms_unpack_from_the_blob():
    f = cact.read_cact(cact_path("t158"))
    idx, norms = f.codes("layer00.q_proj")
    assert idx.shape == (64, 128) and norms.shape == (64, 1) and norms.dtype == np.float16
    assert set(np.unique(idx)) <= {0, 1, 2}  # ternary indices, from crumbs {3, 0, 1}
    assert f.blob("layer00.q_proj") == cact.pack_codes(idx, 1.58).tobytes() + norms.tobytes()
    with pytest.raises(CheckpointError, match="is FP16, not CQ"):
        f.codes("layer00.norm_in")
    with pytest.raises(KeyError, match="no record named 'nope'"):
        f.record("nope")


# ----------------------------------------------------------------------------- writing


def fragile_byte_spans(variant: str, records: list[cact.CactRecord]) -> list[tuple[int, int]]:
    """Byte ranges of the README's fragile groups: the group's packed codes and its fp16 norm."""
    spans = []
    for rec_i, row, group, _why in QUANT.get(f"{variant}/fragile_groups", np.zeros((0, 4), np.int64)):
        rec = records[rec_i]
        out, in_pad = rec.shape[0], cact.padded(rec.shape[1], rec.group)
        row_bytes = cact.packed_row_bytes(in_pad, rec.bits)
        per_group = row_bytes * rec.group // in_pad
        start = rec.offset + row * row_bytes + group * per_group
        norm = rec.offset + out * row_bytes + 2 * (row * (in_pad // rec.group) + group)
        spans += [(start, start + per_group), (norm, norm + 2)]
    return spans


def byte_differences(ours: bytes, theirs: bytes) -> np.ndarray:
    assert len(ours) == len(theirs), f"{len(ours)} bytes vs upstream's {len(theirs)}"
    return np.flatnonzero(np.frombuffer(ours, np.uint8) != np.frombuffer(theirs, np.uint8))


@pytest.mark.parametrize("variant", VARIANTS)
def test_writer_gives_upstreams_bytes(variant, checkpoint, tmp_path):
    args = META["variants"][variant]["write_export_args"]
    dst = tmp_path / "out.cact"
    info = cact.write_cact(checkpoint.params, checkpoint.config, dst, bits=args["bits"], bits_map=args["bits_map"],
                           tokenizer=SPM if args["tokenizer"] else None, kv_window=args["kv_window"])
    ours, theirs = dst.read_bytes(), cact_path(variant).read_bytes()
    assert info == {"path": str(dst), "bytes": len(theirs), "tensors": META["variants"][variant]["num_tensors"]}
    records = cact.read_cact(cact_path(variant)).records
    table_end = DIR0 + cact.RECORD_SIZE * len(records)
    assert ours[:table_end] == theirs[:table_end]  # header, codebook and directory: identical
    diff = byte_differences(ours, theirs)
    spans = fragile_byte_spans(variant, records)
    outside = [int(d) for d in diff if not any(a <= d < b for a, b in spans)]
    assert not outside, f"{len(diff)} bytes differ, {len(outside)} outside the fragile groups, first at {outside[:5]}"
    assert len(diff) == 0  # measured: not even the fragile group differs (same numpy calls as upstream)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize(("variant", "kwargs"), [
    ("q4", {}),  # `needle build CKPT`: 4 bits, kv_window = effective_kv_window (160)
    ("q4tok", {"tokenizer": SPM}),
    ("q2", {"bits": 2}),
    ("t158", {"bits": 1.58}),  # README-cact: write_export(bits=1.58) gives the t158 bytes
    ("mixed", {"weight_bits": "default=2,embedding=4,attn.q_proj=3"}),  # the map from config.weight_bits
])
def test_build_defaults_are_needle_builds(variant, kwargs, checkpoint):
    config = checkpoint.config.replace(weight_bits=kwargs.pop("weight_bits", ""))
    params32 = unflatten_tree({k: np.asarray(v, np.float32) for k, v in flatten_tree(checkpoint.params).items()})
    for params in (checkpoint.params, params32):  # fp16 widens exactly: the same bytes either way
        assert cact.build_cact(params, config, **kwargs) == cact_path(variant).read_bytes()


def test_tokenizer_blob_is_upstreams():
    blob = cact.tokenizer_blob(SPM)
    assert blob == QUANT["tok/blob"].tobytes() == QUANT["q4tok/tokenizer_blob"].tobytes()
    assert cact.tokenizer_blob(SPM.read_bytes()) == blob
    parsed = cact.parse_tokenizer_blob(blob)
    np.testing.assert_array_equal(np.array(parsed["types"], np.uint8), QUANT["tok/types"])
    np.testing.assert_array_equal(np.array(parsed["scores"], np.float32), QUANT["tok/scores"])
    assert parsed["pieces"] == json.loads(str(QUANT["tok/pieces_json"]))
    assert (parsed["pad_id"], parsed["eos_id"], parsed["bos_id"], parsed["unk_id"]) == (0, 1, 2, 3)
    assert parsed["add_dummy_prefix"] and parsed["byte_fallback"]
    spm = pytest.importorskip("sentencepiece")
    assert cact.tokenizer_blob(spm.SentencePieceProcessor(model_file=str(SPM))) == blob  # the same via the package


def test_writer_refuses_what_the_header_cannot_hold(tmp_path):
    five_orders = TransformerConfig(vocab_size=64, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2,
                                    engram_layers=(1,), engram_orders=(2, 3, 4, 5, 6), engram_slots=16)
    with pytest.raises(ConfigError, match=r"engram_orders=\[2, 3, 4, 5, 6\] has 5 entries; a .cact header holds 4 "
                                          r"\(upstream's exporter silently drops the rest"):
        cact.write_cact({}, five_orders, tmp_path / "x.cact")
    five_sites = five_orders.replace(engram_orders=(2, 3), num_layers=6, engram_layers=(0, 1, 2, 3, 4))
    with pytest.raises(ConfigError, match=r"engram_layers=\[0, 1, 2, 3, 4\] has 5 entries"):
        cact.write_cact({}, five_sites, tmp_path / "x.cact")
    assert list(tmp_path.iterdir()) == []


def test_writer_refusals_leave_nothing_behind(checkpoint, tmp_path):
    dst = tmp_path / "out.cact"
    with pytest.raises(TokenizerError, match="the tokenizer has 512 pieces but config.vocab_size is 1024"):
        cact.write_cact(checkpoint.params, checkpoint.config.replace(vocab_size=1024), dst, tokenizer=SPM)
    flat = flatten_tree(checkpoint.params)
    del flat["stack/final_norm/scale"]
    with pytest.raises(CheckpointError, match="stack/final_norm/scale"):
        cact.write_cact(unflatten_tree(flat), checkpoint.config, dst)
    with pytest.raises(ConfigError, match="bits=8 is not a CQ width"):
        cact.write_cact(checkpoint.params, checkpoint.config, dst, bits=8)
    with pytest.raises(ConfigError, match="has no default"):
        cact.write_cact(checkpoint.params, checkpoint.config, dst, bits_map="embedding=4")
    assert list(tmp_path.iterdir()) == []


def test_writer_never_overwrites_without_force(checkpoint, tmp_path):
    dst = tmp_path / "out.cact"
    dst.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match="already exists; pass --force"):
        cact.write_cact(checkpoint.params, checkpoint.config, dst)
    assert dst.read_bytes() == b"precious"
    cact.write_cact(checkpoint.params, checkpoint.config, dst, force=True)
    assert dst.read_bytes() == cact_path("q4").read_bytes() and leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- back to the Flax tree


@pytest.mark.parametrize("variant", VARIANTS)
def test_to_params_undoes_the_layout(variant, checkpoint):
    f = cact.read_cact(cact_path(variant))
    params, config, lossy = cact.to_params(f)
    flat, ref = flatten_tree(params), flatten_tree(checkpoint.params)
    L = config.num_layers
    # CQ leaves are the read tensors with the transposes and reshapes undone
    q = np.stack([f.tensor(f"layer{i:02d}.q_proj").T for i in range(L)])
    np.testing.assert_array_equal(flat["stack/layers/block/self_attn/q_proj/kernel"], q)
    phi = f.tensor("mhc_phi_res").reshape(L, 16, 256).transpose(0, 2, 1)  # (L·n², n·D) -> (L, n·D, n²)
    np.testing.assert_array_equal(flat["stack/mhc_phi_res"], phi)
    np.testing.assert_array_equal(flat["engrams_1/embedding"], f.tensor("engram1.tables").reshape(2, 257, 32))
    np.testing.assert_array_equal(flat["engrams_0/value_proj/kernel"], f.tensor("engram0.value_proj").T)
    np.testing.assert_array_equal(flat["embedding/embedding"], f.tensor("embedding"))
    # FP16 leaves are the checkpoint's (fp16) values exactly, heads included
    for path in lossy.fp16:
        np.testing.assert_array_equal(flat[path], ref[path].astype(np.float32), err_msg=path)
    assert all(a.dtype == np.float32 for a in flat.values())
    assert set(lossy.cq) | set(lossy.fp16) | {"contrastive_head/log_temp"} == set(flat)
    assert {p.split("/")[0] for p in set(ref) - set(flat)} == {"mtp_combine", "mtp_emb_norm", "mtp_final_norm",
                                                                "mtp_block"}
    assert lossy.absent == ("mtp",) and lossy.notes == ()
    assert flat["contrastive_head/log_temp"] == np.float32(math.log(0.07))
    assert "contrastive_head/log_temp" in lossy.synthesised
    assert any("contrastive_head.bias" in d for d in lossy.dropped)
    assert ("tokenizer (RAW)" in lossy.dropped) == (variant == "q4tok")
    # the config: everything the header stores, the implied bits map, upstream's defaults for the rest
    implied = {"q4": "", "q4tok": "", "q2": "default=2", "t158": "default=1.58",
               "mixed": "default=2,embedding=4,attn.q_proj=3"}[variant]
    assert config.differences(checkpoint.config) == ({"weight_bits": (implied, "")} if implied else {})
    # the torch side accepts it: both probe heads, no MTP
    state = flax_to_torch(params, config)
    assert any(k.startswith("contrastive_head.") for k in state) and any(k.startswith("confidence_head.")
                                                                          for k in state)
    assert not any(k.startswith("mtp") for k in state)


@pytest.mark.parametrize("variant", READ_VARIANTS)
def test_to_params_cq_leaves_are_the_quantizers(variant):
    """The reader and the tree quantizer meet: the exported CQ leaves equal upstream's fake-quant tree."""
    golden = np.load(DATA / f"needle-v2-tiny.quant.{variant}.cq.npz")
    params, _, lossy = cact.to_params(cact_path(variant))
    flat = flatten_tree(params)
    worst = max(float(np.max(np.abs(flat[p] - golden[p]))) for p in lossy.cq)
    assert worst <= READ_TOL  # README-cact checks: read vs tree ≤ 7.2e-7


def test_rewriting_to_params_keeps_the_widths_and_fp16_records(tmp_path):
    params, config, _ = cact.to_params(cact_path("mixed"))
    cact.write_cact(params, config, tmp_path / "again.cact")
    again = cact.read_cact(tmp_path / "again.cact")
    original = cact.read_cact(cact_path("mixed"))
    assert [r.bits for r in again.records] == [r.bits for r in original.records]  # config.weight_bits implied
    for r in original.records:
        if r.dtype == cact.FP16:
            assert again.blob(r.index) == original.blob(r.index), r.name


OTHER = TransformerConfig(vocab_size=96, d_model=48, attn_dim=32, num_heads=2, num_kv_heads=1, num_layers=3,
                          engram_layers=(0, 2), engram_orders=(2, 3, 4), engram_heads=2, engram_slots=11, mhc_lanes=3,
                          contrastive_dim=16, max_seq_len=300, kv_window=200, rope_theta=10000.0)


@pytest.mark.parametrize("groups", [(), ("confidence",), ("mtp", "contrastive", "confidence")])
def test_round_trip_of_a_config_unlike_the_fixtures(groups, tmp_path):
    """P ≠ D (48 -> 64), A ≠ D, MQA, 3 orders with E = 2, 3 lanes, a kv_window, some heads: write, lint, read back."""
    spec = "default=3,attn.v_proj=1.58,engram1=2"
    params = random_flax_params(OTHER, seed=1, groups=groups)
    path = tmp_path / "other.cact"
    cact.write_cact(params, OTHER, path, bits_map=spec)
    assert cact.lint(path) == [] and cact.lint(path, bits_map=spec) == []
    back, config, lossy = cact.to_params(path)
    flat, ref = flatten_tree(back), flatten_tree(params)
    fake = flatten_tree(cq_mixed_params(params, *parse_bits_map(spec)))
    for path_ in flat:
        assert flat[path_].shape == np.shape(ref[path_]), path_
        if path_ in lossy.cq:
            assert np.max(np.abs(flat[path_] - fake[path_])) <= READ_TOL, path_  # the quantizer's values
        elif path_ in lossy.fp16:
            np.testing.assert_array_equal(flat[path_], ref[path_].astype(np.float16).astype(np.float32))
    assert set(ref) - set(flat) == {p for p in ref if p.startswith("mtp")}
    diff = config.differences(OTHER)
    implied = diff.pop("weight_bits")[0]  # the same widths, spelled per tensor
    f = cact.read_cact(path)
    assert all(bits_for(r.name, *parse_bits_map(implied)) == bits_for(r.name, *parse_bits_map(spec))
               for r in f.records if r.dtype == cact.CQ)
    assert diff == ({} if "contrastive" in groups else {"contrastive_dim": (128, 16)})  # no head: not stored
    assert lossy.absent == ("mtp",) + tuple(g for g in ("contrastive", "confidence") if g not in groups)


# ----------------------------------------------------------------------------- lint and damaged files


@pytest.mark.parametrize("variant", VARIANTS)
def test_lint_passes_upstreams_files(variant):
    assert cact.lint(cact_path(variant)) == []
    args = META["variants"][variant]["write_export_args"]
    assert cact.lint(cact_path(variant), bits_map=args["bits_map"] or f"default={args['bits']}") == []


def damaged(tmp_path: Path, edit, variant: str = "q4") -> Path:
    """A copy of an upstream file with `edit(bytearray)` applied."""
    buf = bytearray(cact_path(variant).read_bytes())
    result = edit(buf)
    if isinstance(result, bytearray):  # an edit may return a new (cut or grown) buffer
        buf = result
    path = tmp_path / f"damaged-{variant}.cact"
    path.write_bytes(bytes(buf))
    return path


def rec_field(i: int, field: str) -> tuple[str, int]:
    """(struct format, byte offset) of one field of directory record i."""
    where = {"dtype": ("<B", 0), "ndim": ("<B", 1), "shape0": ("<I", 4), "shape1": ("<I", 8), "offset": ("<Q", 20),
             "nbytes": ("<Q", 28), "group": ("<I", 36), "bits": ("<I", 40)}[field]
    return where[0], DIR0 + cact.RECORD_SIZE * i + where[1]


def put(buf: bytearray, i: int, field: str, value: int) -> None:
    fmt, at = rec_field(i, field)
    struct.pack_into(fmt, buf, at, value)


def put_header(buf: bytearray, name: str, value) -> None:
    struct.pack_into("<f" if name == "rope_theta" else "<I", buf, 4 * cact.HEADER_FIELDS.index(name), value)


def test_lint_names_a_wrong_tag(tmp_path):
    problems = cact.lint(damaged(tmp_path, lambda b: put_header(b, "tag", 0x05E12A82)))
    assert len(problems) == 1
    assert "wrong tag 0x05E12A82, expected 0x05E12A83" in problems[0] and "upstream issue #58" in problems[0]
    problems = cact.lint(damaged(tmp_path, lambda b: put_header(b, "tag", 0x05E12A84)))
    assert "a Needle 3 file" in problems[0]


def test_lint_names_an_overlapping_offset(tmp_path):
    path = damaged(tmp_path, lambda b: put(b, 2, "offset", 38272))  # layer00.q_proj onto layer00.norm_in's blob
    problems = cact.lint(path)
    assert any("record 2 (layer00.q_proj): its blob at 38272 overlaps the one before it" in p for p in problems)


def test_lint_names_a_misaligned_blob(tmp_path):
    def move_attn_gate(b):  # its 2-byte blob moved by 2 bytes, the old place zeroed
        b[55554:55556], b[55552:55554] = b[55552:55554], bytes(2)
        put(b, 10, "offset", 55554)
    problems = cact.lint(damaged(tmp_path, move_attn_gate))
    assert problems == ["record 10 (layer00.attn_gate): offset 55554 is not 64-byte aligned (offset % 64 = 2); "
                        "the engine maps blobs at aligned addresses"]


def test_lint_names_a_record_count_that_fits_no_layout(tmp_path):
    problems = cact.lint(damaged(tmp_path, lambda b: put_header(b, "num_tensors", 95)))
    assert len(problems) == 1 and "95 records do not fit the header's geometry: L=5 layers and G=2" in problems[0]


def test_lint_names_truncation(tmp_path):
    problems = cact.lint(damaged(tmp_path, lambda b: b[:-10]))
    assert problems == ["record 94: its blob [248064, 249088) lies outside the data area [4456, 249080) of this "
                        "249080-byte file; the directory is damaged or the file truncated"]


def test_lint_names_bits_that_contradict_the_map(tmp_path, checkpoint):
    problems = cact.lint(cact_path("q4"), bits_map="default=4,attn.q_proj=3")
    assert len(problems) == 5 and "record 2 (layer00.q_proj): 4 bits, but the bits map" in problems[0]
    # a file where one layer's q_proj has another width: no bits map can give that
    config = checkpoint.config
    geo = cact.Geometry.of_config(config, config.effective_kv_window)
    flat = {k: np.asarray(v) for k, v in flatten_tree(checkpoint.params).items()}
    blobs = cact._blobs(flat, geo, 4)
    i = cact.read_cact(cact_path("q4")).names.index("layer01.q_proj")
    kernel = flat["stack/layers/block/self_attn/q_proj/kernel"][1].T
    blobs[i] = cact._cq("layer01.q_proj", kernel, 2)
    path = tmp_path / "odd.cact"
    path.write_bytes(cact._pack(blobs, geo))
    assert cact.lint(path) == ["layer01.q_proj has 2 bits but the other attn.q_proj records have 4: no bits map "
                               "gives one tensor different widths in different layers"]
    restored = cact.to_params(path)
    assert restored.config.weight_bits == "" and "fit no bits map" in restored.lossy.notes[0]  # no map to imply


def test_lint_names_layout_damage(tmp_path):
    gap = cact.lint(damaged(tmp_path, lambda b: b.__setitem__(55560, 0xFF)))  # inside the gap after attn_gate
    assert gap == ["record 11 (layer00.pre_hada): the 62-byte gap before its blob is not zero"]
    tail = cact.lint(damaged(tmp_path, lambda b: b + bytes(10)))
    assert tail == ["10 bytes after the last blob (upstream's file ends with it)"]
    cb = cact.lint(damaged(tmp_path, lambda b: struct.pack_into("<f", b, cact.HEADER_SIZE, -0.5)))
    assert len(cb) == 1 and cb[0].startswith("header codebook differs from upstream's Lloyd-Max codebooks")


def test_lint_names_damaged_values(tmp_path):
    rec = cact.read_cact(cact_path("q4")).record("layer00.k_proj")  # (32, 64): 32 norms at the blob's end
    problems = cact.lint(damaged(tmp_path, lambda b: struct.pack_into("<H", b, rec.offset + rec.nbytes - 2, 0x7C00)))
    assert problems == ["record 3 (layer00.k_proj): 1 non-finite fp16 group norms"]  # +inf
    problems = cact.lint(damaged(tmp_path, lambda b: struct.pack_into("<e", b, rec.offset + rec.nbytes - 2, -1.0)))
    assert problems == ["record 3 (layer00.k_proj): 1 negative group norms"]


def test_lint_names_shapes_against_the_header(tmp_path):
    def shrink_q_norm(b):  # a coherent record of the wrong shape: 8 values, the other 8 zeroed
        put(b, 5, "shape0", 8)
        put(b, 5, "nbytes", 16)
        b[46848 + 16:46848 + 32] = bytes(16)
    problems = cact.lint(damaged(tmp_path, shrink_q_norm))
    assert problems == ["record 5 (layer00.q_norm): FP16 (8,), but the header's geometry gives FP16 (16,)"]
    problems = cact.lint(damaged(tmp_path, lambda b: put_header(b, "engram_conv_dilation", 2)))
    assert len(problems) == 1 and "engram_conv_dilation=2, but the geometry it describes gives 3" in problems[0]


MANIFEST = int(QUANT["q4/records"][89][7])  # offset of q4's heads.manifest blob (FP16 [1, 2])

# Hostile headers and directories: one CheckpointError line each, and no allocation beyond the file's size.
HOSTILE = [
    ("zero-byte", lambda b: bytearray(), "0 bytes, shorter than the 120-byte .cact header: the file is empty or "
                                         "truncated"),
    ("cut-in-header", lambda b: b[:100], "100 bytes, shorter than the 120-byte .cact header"),
    ("cut-in-directory", lambda b: b[:3000], "need 4456 bytes before the first blob, but the file has 3000"),
    ("cut-in-blobs", lambda b: b[:200_000], "record 84 (engram1.tables): its blob [186944, 220868) lies outside"),
    ("huge-count", lambda b: put_header(b, "num_tensors", 2**32 - 1), "and 4294967295 records, which need"),
    ("huge-codebook", lambda b: put_header(b, "codebook_len", 2**32 - 1), "a 4294967295-value codebook"),
    ("huge-layers", lambda b: put_header(b, "num_layers", 2**32 - 1), "96 records do not fit the header's "
                                                                      "geometry: L=4294967295"),
    ("offset-past-end", lambda b: put(b, 5, "offset", 10**12), "record 5 (layer00.q_norm): its blob "
                                                               "[1000000000000, 1000000000032) lies outside"),
    ("offset-in-header", lambda b: put(b, 1, "offset", 100), "record 1 (layer00.norm_in): its blob [100, 228)"),
    ("huge-nbytes", lambda b: put(b, 5, "nbytes", 2**63), "record 5 (layer00.q_norm): its blob [46848, "
                                                          "9223372036854822656) lies outside"),
    ("absurd-ndim", lambda b: put(b, 2, "ndim", 200), "record 2 (layer00.q_proj): ndim 200 is more than the 4"),
    ("absurd-fp16-shape", lambda b: put(b, 1, "shape0", 2**31), "record 1 (layer00.norm_in): nbytes 128, but FP16 "
                                                                "(2147483648,) takes 4294967296"),
    ("absurd-cq-shape", lambda b: (put(b, 2, "shape0", 2**31), put(b, 2, "shape1", 2**31)),
     "record 2 (layer00.q_proj): nbytes 4224, but CQ (2147483648, 2147483648) at 4 bits takes"),
    ("absurd-group", lambda b: put(b, 2, "group", 2**31), "CQ group 2147483648 is not a power of two in 8..1024"),
    ("unknown-dtype", lambda b: put(b, 2, "dtype", 9), "record 2 (layer00.q_proj): unknown dtype 9"),
    ("bad-bits", lambda b: put(b, 2, "bits", 7), "CQ bits 7 is not 2, 3, 4 or 5"),
    ("wrong-tag", lambda b: put_header(b, "tag", 0x12345678), "wrong tag 0x12345678, expected 0x05E12A83"),
    ("bad-manifest", lambda b: struct.pack_into("<e", b, MANIFEST + 2, 7.0), "heads.manifest) holds codes [1.0, 7.0]"),
]


@pytest.mark.parametrize(("case", "edit", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_files_are_one_line_refusals(case, edit, message, tmp_path):
    path = damaged(tmp_path, edit)
    size = path.stat().st_size
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError) as e:
            cact.read_cact(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    text = str(e.value)
    assert message in text and "\n" not in text and text.startswith(str(path))
    assert peak < size + 256 * 1024, f"{case}: peak {peak} bytes allocated for a {size}-byte file"
    problems = cact.lint(path)  # lint says the same, without raising
    assert problems and message in problems[0]


def test_manifest_offset_is_where_the_test_damages_it():
    rec = cact.read_cact(cact_path("q4")).record("heads.manifest")
    assert rec.offset == MANIFEST and rec.nbytes == 4  # HOSTILE "bad-manifest" writes the second code


def test_a_damaged_ternary_code_is_refused(tmp_path):
    f = cact.read_cact(cact_path("t158"))
    rec = f.record("layer00.q_proj")
    path = damaged(tmp_path, lambda b: b.__setitem__(rec.offset, 0b10), "t158")  # crumb 2 (-2): no trit
    with pytest.raises(CheckpointError, match=r"record 2 \(layer00.q_proj\): CQ code 255 is outside the 3-entry"):
        cact.read_cact(path).tensor(2)


def test_empty_records_read_as_empty_arrays(tmp_path):
    def no_rows(b):  # layer00.q_proj as a coherent (0, 64) CQ record
        put(b, 2, "shape0", 0)
        put(b, 2, "nbytes", 0)
    path = damaged(tmp_path, no_rows)
    assert cact.read_cact(path).tensor(2).shape == (0, 64)
    problems = cact.lint(path)
    assert "record 2 (layer00.q_proj): CQ (0, 64), but the header's geometry gives CQ (64, 64)" in problems
    with pytest.raises(CheckpointError, match=r"record 2 \(layer00.q_proj\): CQ \(0, 64\), but"):
        cact.to_params(path)


def test_random_damage_never_escapes_as_a_traceback(tmp_path):
    """Seeded random corruption of the header, directory and blobs (and cuts): reading every tensor, to_params
    and lint either work or raise one project error line, never another exception."""
    src = cact_path("q4tok").read_bytes()
    table_end = DIR0 + cact.RECORD_SIZE * 97
    rng = np.random.default_rng(0)
    path = tmp_path / "fuzz.cact"
    outcomes = {"read": 0, "refused": 0}
    for _ in range(150):
        b = bytearray(src)
        for _ in range(int(rng.integers(1, 4))):
            kind = int(rng.integers(0, 3))
            if kind == 0:  # a random u32 in the header or directory, often an extreme one
                at = int(rng.integers(0, table_end // 4)) * 4
                value = int(rng.choice([0, 1, 2**31, 2**32 - 1, int(rng.integers(0, 2**32))]))
                struct.pack_into("<I", b, at, value)
            elif kind == 1:  # a random byte anywhere
                b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
            else:
                del b[int(rng.integers(0, len(b))):]
            if not b:
                break
        path.write_bytes(bytes(b))
        try:
            f = cact.read_cact(path)
            f.tensors()
            cact.to_params(f)
            outcomes["read"] += 1
        except NeedleTwinError as e:
            assert "\n" not in str(e)
            outcomes["refused"] += 1
        assert isinstance(cact.lint(path), list)
    assert outcomes["read"] and outcomes["refused"]  # both kinds happened


def test_missing_and_directory_paths(tmp_path):
    with pytest.raises(CheckpointError, match="cannot read"):
        cact.read_cact(tmp_path / "nope.cact")
    with pytest.raises(CheckpointError, match="is a directory; give a .cact file"):
        cact.read_cact(tmp_path)
    assert cact.lint(tmp_path / "nope.cact")[0].endswith("give an existing .cact file")


def test_the_copy_helper_does_not_touch_the_fixtures(tmp_path):
    before = cact_path("q4").read_bytes()
    damaged(tmp_path, lambda b: put_header(b, "tag", 0))
    assert cact_path("q4").read_bytes() == before
    shutil.copy(cact_path("q4"), tmp_path / "copy.cact")
    assert cact.lint(tmp_path / "copy.cact") == []
