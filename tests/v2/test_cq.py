"""Needle 2's CQ quantizer and bits maps against upstream's goldens (tests/data/README-cact.md).

Goldens: `needle-v2-tiny.quant.npz` (codebooks), `needle-v2-tiny.quant.{q4,q2,mixed,t158}.cq.npz`
(upstream's `cq_quantize_params` / `cq_mixed_params` on the fixture checkpoint widened to f32) and
the upstream-written `.cact` files, whose CQ records hold upstream's codes and fp16 norms for the
same weights at the same widths.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from convert.errors import ConfigError
from convert.io import read_checkpoint
from convert.trees import flatten_tree, unflatten_tree
from convert.v2 import bits as B
from convert.v2 import cq
from convert.v2.cact import read_cact

DATA = Path(__file__).resolve().parents[1] / "data"
QUANT = np.load(DATA / "needle-v2-tiny.quant.npz")
MIXED = "default=2,embedding=4,attn.q_proj=3"
# variant -> (bits map, default) of upstream's producing call (README-cact "`.cq.npz`")
VARIANTS = {"q4": ({}, 4), "q2": ({}, 2), "mixed": B.parse_bits_map(MIXED), "t158": ({}, 1.58)}
# README-cact "Tolerances": the JAX quantizer and numpy agree to float32 rounding of (cb·norm)·H (~1e-7 here);
# one fp16 ulp of a norm would move values by >= ~1e-5, one code by a whole codebook step.
DEQ_TOL = 1e-6


@pytest.fixture(scope="module")
def checkpoint():
    return read_checkpoint(DATA / "needle-v2-tiny.pkl")


@pytest.fixture(scope="module")
def p32(checkpoint):
    return unflatten_tree({k: np.asarray(v, np.float32) for k, v in flatten_tree(checkpoint.params).items()})


def group_view(path: str, leaf: np.ndarray) -> np.ndarray:
    """README-cact's group view: (rows, in) with groups along in."""
    if B.groups_along_input(path):
        return np.swapaxes(leaf, -1, -2).reshape(-1, leaf.shape[-2])
    return leaf.reshape(-1, leaf.shape[-1])


# ----------------------------------------------------------------------------- codebooks


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_lloyd_max_refit_is_upstreams_exactly(bits):
    unit = cq.lloyd_max_gaussian(bits)
    assert unit.dtype == np.float64
    np.testing.assert_array_equal(unit, QUANT[f"codebook_unit/{bits}"])  # float64, bit for bit
    np.testing.assert_array_equal(cq.codebook(bits), QUANT[f"codebook/{bits}"])
    assert cq.codebook(bits).dtype == np.float32


def test_ternary_codebook():
    np.testing.assert_array_equal(cq.unit_codebook(1.58), QUANT["codebook_unit/1.58"])
    np.testing.assert_array_equal(cq.codebook(1.58), QUANT["codebook/1.58"])


def test_codebook_values_match_the_spec():
    # NEEDLE_V2.md §5 prints the ×√g values to 6 decimals (independent of the fixture file)
    spec = {2: [-1.506671, -0.451441, 0.452948, 1.509933],
            3: [-2.141248, -1.333716, -0.748398, -0.237740, 0.250045, 0.755587, 1.337983, 2.147636]}
    for bits, values in spec.items():
        np.testing.assert_allclose(cq.lloyd_max_gaussian(bits), values, atol=6e-7)  # 6 printed decimals
    four = cq.lloyd_max_gaussian(4)
    np.testing.assert_allclose(four[[0, 1, -2, -1]], [-2.709990, -2.044456, 2.084426, 2.741014], atol=6e-7)


@pytest.mark.parametrize("variant", ["q4", "q2", "mixed", "t158", "q4tok"])
def test_header_codebook_is_the_fitted_one(variant):
    expected = np.concatenate([cq.codebook(b) for b in (2, 3, 4)])
    np.testing.assert_array_equal(QUANT[f"{variant}/header_codebook"], expected)
    np.testing.assert_array_equal(read_cact(DATA / f"needle-v2-tiny.{variant}.cact").codebook, expected)


def test_hadamard_is_orthonormal_sylvester():
    h = cq.cq_hadamard(128)
    assert h.dtype == np.float32 and h.shape == (128, 128)
    np.testing.assert_allclose(h.astype(np.float64) @ h.T, np.eye(128), atol=1e-6)  # f32 entries ±1/√128
    assert h[0, 0] > 0 and h[1, 1] < 0 and h[1, 0] > 0  # natural (Sylvester) order: H2 = [[1, 1], [1, -1]]


# ----------------------------------------------------------------------------- the quantizer vs the goldens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_quantizer_reproduces_every_leaf(variant, p32):
    golden = np.load(DATA / f"needle-v2-tiny.quant.{variant}.cq.npz")
    paths = json.loads(str(golden["paths_json"]))
    bits = json.loads(str(golden["bits_json"]))
    out = flatten_tree(cq.cq_mixed_params(p32, *VARIANTS[variant]))
    flat = flatten_tree(p32)
    assert sorted(cq.quant_leaf_names(p32)) == sorted(paths) and len(paths) == 23  # the same leaves
    worst = 0.0
    for path in paths:
        assert out[path].dtype == np.float32 and out[path].shape == golden[path].shape, path
        assert B.bits_for(path, *VARIANTS[variant]) == bits[path], path
        worst = max(worst, float(np.max(np.abs(out[path] - golden[path]))))
    assert worst <= DEQ_TOL, f"{variant}: max |Δ| {worst:.3g} vs upstream's quantizer"
    for path in set(flat) - set(paths):
        assert out[path] is flat[path], path  # every other leaf is returned as given


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_codes_and_norms_are_upstreams_bit_for_bit(variant, p32):
    """Our codes and fp16 norms for each exported leaf equal the ones upstream stored in its `.cact` for the same
    weights and widths (the export and the tree quantizer agree everywhere on tiny: README-cact "Checks")."""
    cact = read_cact(DATA / f"needle-v2-tiny.{variant}.cact")
    flat = flatten_tree(p32)
    spec = VARIANTS[variant]
    checked = 0
    for rec in cact.records:
        if rec.dtype != 3:
            continue
        mat = _record_matrix(rec.name, flat, cact.geometry)
        idx, norm16 = cq.cq_encode(mat, B.bits_for(rec.name, *spec))
        file_idx, file_norms = cact.codes(rec.index)
        np.testing.assert_array_equal(idx, file_idx, err_msg=rec.name)
        np.testing.assert_array_equal(norm16.view(np.uint16), file_norms.view(np.uint16), err_msg=rec.name)
        checked += 1
    assert checked == 35  # embedding, 5·5 projections, 3 φ, 2·3 engram


def _record_matrix(name: str, flat: dict, geo) -> np.ndarray:
    """The (out, in) matrix a CQ record is made from (NEEDLE_V2.md §7.3 "Order")."""
    if name == "embedding":
        return flat["embedding/embedding"]
    if name.startswith("layer"):
        layer, proj = name.split(".")
        return flat[f"stack/layers/block/self_attn/{proj}/kernel"][int(layer[5:])].T
    if name.startswith("mhc_phi"):
        phi = flat[f"stack/{name}"]
        return phi.transpose(0, 2, 1).reshape(-1, phi.shape[1])
    site, what = name.split(".")
    g = f"engrams_{site[6:]}"
    if what == "tables":
        return flat[f"{g}/embedding"].reshape(-1, geo.engram_sub_dim)
    return flat[f"{g}/{what}/kernel"].T


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_unpadded_leaves_not_exported_recover_upstreams_codes(variant, p32):
    """For leaves the export drops (MTP, heads) the only golden is the dequantised value; where the groups are
    unpadded the codes and fp16 norms can be recovered from it exactly: rot = deq·H ≈ cb[idx]·norm16."""
    golden = np.load(DATA / f"needle-v2-tiny.quant.{variant}.cq.npz")
    spec = VARIANTS[variant]
    h = cq.cq_hadamard(cq.GROUP).astype(np.float64)
    flat = flatten_tree(p32)
    recovered = 0
    for path in ("mtp_combine/kernel", "contrastive_head/proj/kernel", "confidence_head/proj/kernel",
                 "stack/mhc_phi_pre", "stack/mhc_phi_res"):
        bits = B.bits_for(path, *spec)
        view = group_view(path, flat[path])
        assert view.shape[1] % cq.GROUP == 0  # unpadded: the golden holds every rotated coordinate
        idx, norm16 = cq.cq_encode(view, bits)
        rows, groups = norm16.shape
        rot = group_view(path, golden[path]).astype(np.float64).reshape(rows, groups, cq.GROUP) @ h
        cb = cq.codebook(bits).astype(np.float64)
        their_idx = cq.nearest_index(rot / norm16.astype(np.float64)[..., None], cq.codebook(bits)).reshape(idx.shape)
        chosen = cb[their_idx].reshape(rows, groups, cq.GROUP)
        their_norm = ((rot * chosen).sum(-1) / (chosen**2).sum(-1)).astype(np.float16)  # least squares, then fp16
        np.testing.assert_array_equal(their_idx, idx, err_msg=path)
        np.testing.assert_array_equal(their_norm.view(np.uint16), norm16.view(np.uint16), err_msg=path)
        recovered += idx.size
    assert recovered > 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_float16_input_gives_the_fp16_rounding(variant, checkpoint):
    """Upstream returns fp16 leaves for an fp16 tree, the fp16 rounding of its float32 result. Ours differ from
    upstream's float32 by float32 rounding (≤ DEQ_TOL), which moves an fp16 rounding by one ulp only where the
    float32 value sits at an fp16 midpoint: measured 3..200 of 227,968 values."""
    golden = np.load(DATA / f"needle-v2-tiny.quant.{variant}.cq.npz")
    out = flatten_tree(cq.cq_mixed_params(checkpoint.params, *VARIANTS[variant]))
    differ = total = 0
    for path in json.loads(str(golden["paths_json"])):
        assert out[path].dtype == np.float16, path
        got, want = out[path].astype(np.float32), golden[path].astype(np.float16).astype(np.float32)
        ulp = np.spacing(np.maximum(np.abs(got), np.abs(want)).astype(np.float16)).astype(np.float32)
        assert np.all(np.abs(got - want) <= ulp), path  # one fp16 ulp at most
        differ += int(np.count_nonzero(got != want))
        total += want.size
    assert differ <= 0.002 * total  # midpoint cases only (measured ≤ 0.09%)


def test_cq_quantize_groups_along_the_last_axis_with_padding():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 3, 200)).astype(np.float32) * 0.02  # 200: one full and one padded group
    q = cq.cq_quantize(w, 3)
    assert q.shape == w.shape and q.dtype == np.float32
    rows = w.reshape(-1, 200)
    for r in range(rows.shape[0]):  # one row at a time gives the same values
        np.testing.assert_array_equal(cq.cq_quantize(rows[r:r + 1], 3)[0], q.reshape(-1, 200)[r])
    rel = np.linalg.norm(q - w) / np.linalg.norm(w)
    assert 0.05 < rel < 0.3  # 3-bit CQ of Gaussian data: ~0.18 relative error, neither exact nor garbage


def test_norm_is_rounded_but_the_unit_vector_is_not():
    # one group whose norm is not an fp16 value: the stored norm is its fp16 rounding, the codes come from the
    # unrounded unit vector, and dequantising uses the stored norm
    w = np.full((1, 128), 0.0123456, np.float32)
    idx, norm16 = cq.cq_encode(w, 4)
    rot = w.reshape(1, 1, 128) @ cq.cq_hadamard(128)
    norm = np.sqrt((rot**2).sum(-1))
    assert norm16[0, 0] == np.float16(norm[0, 0]) and float(norm16[0, 0]) != float(norm[0, 0])
    unit = rot / norm[..., None]
    np.testing.assert_array_equal(idx, cq.nearest_index(unit, cq.codebook(4)).reshape(1, 128))
    deq = cq.cq_decode(idx, norm16, 128, 4)
    expected = (cq.codebook(4)[idx].reshape(1, 1, 128) * np.float32(norm16[0, 0])) @ cq.cq_hadamard(128)
    np.testing.assert_array_equal(deq, expected.reshape(1, 128))


def test_ties_go_to_the_lower_entry():
    cb = np.array([-1.0, 1.0, 3.0], np.float32)
    x = np.array([0.0, 2.0, -5.0, 5.0, 0.5], np.float32)
    np.testing.assert_array_equal(cq.nearest_index(x, cb), [0, 1, 0, 2, 1])


# ----------------------------------------------------------------------------- packing


def test_pack_is_an_lsb_first_bitstream_per_row():
    idx = np.zeros((2, 8), np.uint8)
    idx[0, :2] = [1, 2]  # 4 bits: even column in the low nibble -> 0x21
    idx[1, :3] = [5, 6, 7]  # 3 bits: 101, 110, 111 LSB-first -> bits 1,0,1, 0,1,1, 1,1,1 -> 0xF5, 0x01
    assert cq.pack_codes(idx[:1], 4).tobytes() == b"\x21" + bytes(3)
    assert cq.pack_codes(idx[1:], 3).tobytes() == b"\xf5\x01\x00"
    assert cq.pack_codes(np.array([[1, 2, 3, 0, 0, 0, 0, 0]], np.uint8), 2).tobytes() == b"\x39\x00"


def test_ternary_crumbs():
    idx = np.array([[0, 1, 2, 0, 2, 2, 1, 0]], np.uint8)  # -> crumbs 3,0,1,3 | 1,1,0,3
    packed = cq.pack_codes(idx, 1.58)
    assert packed.tobytes() == bytes([0b11_01_00_11, 0b11_00_01_01])
    np.testing.assert_array_equal(cq.unpack_codes(packed, cq.TERNARY_RECORD_BITS, 8), idx)
    assert cq.record_bits(1.58) == 5 and cq.width_of_record(5) == 1.58


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_unpack_inverts_pack(bits):
    idx = np.random.default_rng(bits).integers(0, 1 << bits, (5, 256)).astype(np.uint8)
    packed = cq.pack_codes(idx, bits)
    assert packed.shape == (5, 256 * bits // 8)
    np.testing.assert_array_equal(cq.unpack_codes(packed, bits, 256), idx)


# ----------------------------------------------------------------------------- bits maps


@pytest.mark.parametrize(("name", "canon"), [
    ("stack/layers/block/self_attn/q_proj/kernel", "attn.q_proj"),
    ("layer03.q_proj", "attn.q_proj"),
    ("engrams_1/embedding", "engram1.tables"),
    ("engram1.tables", "engram1.tables"),
    ("engrams_0/key_proj/kernel", "engram0.key_proj"),
    ("mtp_block/self_attn/k_proj/kernel", "mtp.k_proj"),
    ("embedding/embedding", "embedding"),
    ("stack/mhc_phi_res", "mhc_phi_res"),
    ("contrastive_head/proj/kernel", "contrastive_head.proj"),
    ("mtp_combine/kernel", "mtp_combine"),
])
def test_canonical_names(name, canon):
    assert B.canonical_name(name) == canon


def test_parse_bits_map_and_longest_prefix():
    m, default = B.parse_bits_map("default=2, embedding=4,layer00.q_proj=3,attn=4,mhc_phi=1.58")
    assert default == 2 and m == {"embedding": 4, "attn.q_proj": 3, "attn": 4, "mhc_phi": 1.58}
    assert B.bits_for("stack/layers/block/self_attn/q_proj/kernel", m, default) == 3  # longest of attn, attn.q_proj
    assert B.bits_for("layer02.k_proj", m, default) == 4
    assert B.bits_for("stack/mhc_phi_post", m, default) == 1.58
    assert B.bits_for("engrams_0/embedding", m, default) == 2  # "embedding" does not prefix "engram0.tables"
    assert B.parse_bits_map("default=4,a=2,a=3")[0] == {"a": 3}  # a repeated key keeps its last width, as upstream


@pytest.mark.parametrize(("spec", "message"), [
    ("embedding=4", "has no default; add a 'default=<bits>' entry"),
    ("", "bits map is empty"),
    ("default=5", "entry 'default=5' has width '5'; use 2, 3, 4 or 1.58"),
    ("default=2.0", "entry 'default=2.0' has width '2.0'"),
    ("default=4,attn.q_proj", "entry 'attn.q_proj' is not KEY=BITS"),
    ("default=4,=3", "entry '=3' is not KEY=BITS"),
    ("default=4,embedding=x", "entry 'embedding=x' has width 'x'"),
])
def test_bad_bits_maps_name_the_entry_and_the_fix(spec, message):
    with pytest.raises(ConfigError) as e:
        B.parse_bits_map(spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_format_bits_map_round_trips():
    for spec in (MIXED, "default=1.58", "default=2"):
        assert B.format_bits_map(*B.parse_bits_map(spec)) == spec
    assert B.format_bits_map({}, 4) == ""  # upstream's plain default


def test_unused_keys_find_typos():
    m, _ = B.parse_bits_map("default=4,atn.q_proj=3,attn.k_proj=2")
    assert B.unused_keys(m, ["layer00.q_proj", "layer00.k_proj"]) == ["atn.q_proj"]


def test_which_leaves_are_quantised_and_along_which_axis():
    assert B.is_quant_leaf("stack/layers/block/self_attn/q_proj/kernel", 3)
    assert B.is_quant_leaf("stack/mhc_phi_pre", 3) and B.is_quant_leaf("engrams_0/embedding", 3)
    assert not B.is_quant_leaf("stack/mhc_b_res", 3) and not B.is_quant_leaf("confidence_head/proj/bias", 1)
    assert not B.is_quant_leaf("some/kernel", 1)  # ndim >= 2 only
    assert B.groups_along_input("stack/mhc_phi_res") and B.groups_along_input("mtp_combine/kernel")
    assert not B.groups_along_input("embedding/embedding") and not B.groups_along_input("engrams_1/embedding")


def test_check_bits():
    assert B.check_bits(4) == 4 and B.check_bits(4.0) == 4 and B.check_bits(1.58) == 1.58
    for bad in (1, 8, 2.5, True, "4"):
        with pytest.raises(ConfigError, match="not a CQ width; use 2, 3, 4 or 1.58"):
            B.check_bits(bad)
