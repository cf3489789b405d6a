"""Rounding flips at the A8 quantisers (parity_tests/flips.py): the margin arithmetic, the walk over the calls, and on
the Needle 3 torch twin a flip forced by a value placed on a rounding boundary (reported, judged outside its
positions, passes) against a weight perturbed by more than float32 noise (fails).

float32 throughout; the budget is the project's float32 budget, unchanged (goldens.F32_REL).
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import convert
from convert.v3 import TransformerConfig
from needle_torch.v3 import SimpleAttentionNetwork
from needle_torch.v3 import model as v3_model
from needle_torch.v3 import quant as v3_quant
from parity_tests import flips
from parity_tests.flips import Call, codes_and_margin, compare, masked_rel
from tests.torch_threads import torch_threads
from tests.v3.goldens import F32_REL, rel

ULP = 2.0**-17  # float32 spacing at 127: the margin unit for A8

TINY = TransformerConfig(vocab_size=96, d_model=32, num_heads=4, num_kv_heads=2, num_layers=3, qk_head_dim=8,
                         v_head_dim=12, max_seq_len=32, engram_layers=(1,), global_layers=(2,), sliding_window=4,
                         engram_slots=31, embedding_dim=16, dtype="float32")


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


# ----------------------------------------------------------------------------- the margin


def test_codes_and_margin_on_exact_boundaries():
    """Row max 127 -> scale 1, so x / scale = x exactly: half-even codes, margins in ulp(127) = 2^-17 of a step."""
    x = np.array([[127, 6.5, 6.5 + ULP, -6.5, 7.5, 0.25, -127]], np.float32)
    codes, margin = codes_and_margin(x, 8)
    assert codes.tolist() == [[127, 6, 7, -6, 8, 0, -127]]
    assert margin.tolist() == [[2**16, 0, 1, 0, 0, 2**15, 2**16]]  # ½ step = 2^16 units, ¼ step = 2^15


def test_margin_follows_the_row_scale_and_bits():
    codes, margin = codes_and_margin(np.array([[254, 13, -3]], np.float32), 8)  # scale 2
    assert codes.tolist() == [[127, 6, -2]] and margin[0, 1] == 0 and margin[0, 2] == 0
    codes, margin = codes_and_margin(np.array([[7, 2.5, 2.5 + 2.0**-21]], np.float32), 4)  # qmax 7, ulp(7) = 2^-21
    assert codes.tolist() == [[7, 2, 3]] and margin.tolist() == [[2**20, 0, 1]]
    codes, margin = codes_and_margin(np.zeros((2, 3), np.float32), 8)  # an all-zero row: scale 1, codes 0
    assert not codes.any() and (margin == 2**16).all()


def test_codes_are_read_from_the_quantisers_output():
    """A compiler may evaluate x / scale to the other side of a boundary (XLA's y for 6.5 came out as 7): the codes
    are the ones the side computed, q / scale, not numpy's rounding of x / scale."""
    x = np.array([[127, 6.5, 3.2]], np.float32)
    codes, margin = codes_and_margin(x, 8, q=np.array([[127, 7, 3]], np.float32))
    assert codes.tolist() == [[127, 7, 3]] and margin[0, 1] == 0


# ----------------------------------------------------------------------------- the walk


def _calls(seed=0):
    """Two calls of a (B 2, T 3, D 4) and a per-head (B 2, H 2, T 3, D 4) quantiser, every value an exact float32
    away from any boundary (scale 1: each row's max is 127)."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in ((2, 3, 4), (2, 2, 3, 4)):
        x = (rng.integers(-100, 100, shape) + 0.25).astype(np.float32)
        x[..., 0] = 127
        out.append(x)
    return out


def test_a_boundary_value_is_a_flip_and_marks_its_row_from_there_on():
    ref = _calls()
    got = [x.copy() for x in ref]
    ref[0][1, 1, 2], got[0][1, 1, 2] = 6.5, 6.5 + ULP  # codes 6 and 7, both within an ulp of 6.5
    got[1][1, :, 2, 3] += 20  # call 1: far off, but at row 1 position 2, which the flip reached
    report = compare([Call(x, x, 8) for x in ref], [Call(x, x, 8, "site", 0) for x in got])
    assert report.ok and not report.divergences, report.summary()
    (flip,) = report.flips
    assert (flip.call, flip.row, flip.position, flip.index, flip.codes) == (0, 1, 1, (1, 1, 2), (6, 7))
    assert flip.margins == (0.0, 1.0) and flip.site == "site" and flip.layer == 0
    assert report.affected.tolist() == [[False, False, False], [False, True, True]]
    assert "1 flip(s), 0 real divergence(s)" in report.summary()


def test_a_difference_far_from_a_boundary_is_a_divergence():
    ref = _calls()
    got = [x.copy() for x in ref]
    got[1][0, 1, 0, 2] += 1  # one whole step, ¼ step from the boundary on both sides
    report = compare([Call(x, x, 8) for x in ref], [Call(x, x, 8) for x in got])
    assert not report.ok and not report.flips
    (d,) = report.divergences
    assert (d.call, d.row, d.position) == (1, 0, 0) and min(d.margins) == 2**15


def test_two_steps_apart_is_a_divergence_even_on_a_boundary():
    ref = _calls()
    got = [x.copy() for x in ref]
    ref[0][0, 0, 1], got[0][0, 0, 1] = 6.5, 8.5  # codes 6 and 8: not one rounding decision
    report = compare([Call(x, x, 8) for x in ref], [Call(x, x, 8) for x in got])
    assert not report.ok and len(report.divergences) == 1


def test_flips_over_half_the_positions_fail():
    ref = _calls()
    got = [x.copy() for x in ref]
    for b in range(2):
        ref[0][b, 0, 1], got[0][b, 0, 1] = 6.5, 6.5 + ULP  # every row flips at position 0: all positions affected
    report = compare([Call(x, x, 8) for x in ref], [Call(x, x, 8) for x in got])
    assert len(report.flips) == 2 and not report.divergences
    assert report.coverage == 1.0 and not report.ok and "too many" in report.summary()


def test_call_orders_that_differ_are_refused():
    ref = _calls()
    with pytest.raises(ValueError, match="1 and 2 quantiser calls"):
        compare([Call(ref[0], ref[0], 8)], [Call(x, x, 8) for x in ref])
    with pytest.raises(ValueError, match="call orders differ"):
        compare([Call(x, x, 8) for x in ref], [Call(x, x, 8) for x in ref[::-1]])


def test_masked_rel_ignores_the_affected_positions():
    ref = np.ones((2, 3, 5), np.float32)
    got = ref.copy()
    got[1, 2] += 1
    mask = np.zeros((2, 3), bool)
    assert masked_rel(got, ref, mask) == 1.0
    mask[1, 2:] = True
    assert masked_rel(got, ref, mask) == 0.0


# ----------------------------------------------------------------------------- on the torch twin


@pytest.fixture(scope="module")
def tiny():
    model = SimpleAttentionNetwork(TINY, groups=())
    model.load_state_dict(convert.flax_to_torch(convert.random_flax_params(TINY, seed=7, groups=()), TINY))
    tokens = torch.as_tensor(np.random.default_rng(7).integers(4, TINY.vocab_size, (3, 10)))
    return model.eval(), tokens


@contextlib.contextmanager
def _placed(calls: list, at: int, row: int, position: int, element: int, value: float):
    """Inside trace_torch: the quantiser call number `at` sees `value` at (row, ..., position, element)."""
    saved = [(m, m.fake_quant_act) for m in (v3_model, v3_quant)]

    for module, recorder in saved:
        def place(x, bits=8, recorder=recorder):
            if len(calls) == at:
                x = x.clone()
                x[row, ..., position, element] = value
            return recorder(x, bits)

        module.fake_quant_act = place
    try:
        yield
    finally:
        for module, recorder in saved:
            module.fake_quant_act = recorder


def _quant_run(model, tokens, place=None, align=None):
    """(quant=True logits, the traced calls); place=(at, row, position, element, value) puts value into one call;
    align: the reference's calls (trace_torch's)."""
    with torch.no_grad(), flips.trace_torch(model, align=align) as calls:
        with _placed(calls, *place) if place else contextlib.nullcontext():
            logits = model(tokens, quant=True)
    return logits.numpy(), calls


def _straddle(x_row: np.ndarray, element: int) -> tuple[float, float]:
    """Two adjacent float32 values for x_row[element] (its row's scale unchanged) that the A8 quantiser rounds to
    neighbouring codes: the two sides of the nearest k + ½ boundary, within an ulp of it."""
    scale = flips.row_scale(x_row, 8)[0]
    y = x_row[element] / scale
    v = np.float32((np.floor(y) + 0.5) * scale)
    candidates = [v]
    for _ in range(8):
        candidates = [np.nextafter(candidates[0], np.float32(-np.inf))] + candidates + [
            np.nextafter(candidates[-1], np.float32(np.inf))]
    row = x_row.copy()
    codes = []
    for c in candidates:
        row[element] = c
        codes.append(codes_and_margin(row, 8)[0][element])
    k = next(i for i in range(len(codes) - 1) if codes[i] != codes[i + 1])
    return float(candidates[k]), float(candidates[k + 1])


def test_a_value_placed_on_a_boundary_is_reported_as_one_flip_and_passes(tiny):
    """Layer 0's attention input, row 1, position 4: on one side a value just below a k + ½ boundary, on the other
    just above it. The flip propagates through attention to every later position of row 1 (the logits there move by
    far more than the float32 budget); the comparison reports exactly that flip and judges the rest exactly."""
    model, tokens = tiny
    _, calls = _quant_run(model, tokens)
    at = next(i for i, c in enumerate(calls) if c.site == "stack.layers.0.block.self_attn:act")
    row, position = 1, 4
    x_row = calls[at].x[row, position]
    element = int(np.argsort(np.abs(x_row))[len(x_row) // 2])  # a middling value: the row's scale stays
    below, above = _straddle(x_row, element)
    ref, ref_calls = _quant_run(model, tokens, (at, row, position, element, below))
    got, got_calls = _quant_run(model, tokens, (at, row, position, element, above))

    report = compare(ref_calls, got_calls)
    assert report.ok, report.summary()
    (flip,) = report.flips
    assert (flip.call, flip.layer, flip.row, flip.position, flip.index[-1]) == (at, 0, row, position, element)
    assert flip.site == "stack.layers.0.block.self_attn:act" and max(flip.margins) <= 2
    expected = np.zeros((3, 10), bool)
    expected[row, position:] = True
    assert np.array_equal(report.affected, expected)
    assert rel(got, ref) > 10 * F32_REL  # the flip is visible in the logits ...
    assert masked_rel(got, ref, report.affected) <= F32_REL  # ... and only where it reached


def _perturbed(model) -> SimpleAttentionNetwork:
    """A copy of `model` whose layer-1 q_proj weights each move by ±1e-3 of themselves (~10^4 times float32 noise;
    random signs, since a per-row A8 code is blind to a uniform scale)."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    w = state["stack.layers.1.block.self_attn.q_proj.weight"]
    w *= 1 + 1e-3 * torch.as_tensor(np.random.default_rng(0).choice([-1.0, 1.0], w.shape), dtype=w.dtype)
    bad = SimpleAttentionNetwork(TINY, groups=())
    bad.load_state_dict(state)
    return bad.eval()


def test_an_aligned_run_takes_the_flip_and_is_judged_at_every_position(tiny):
    """The same placed flip, traced with align=the reference's calls (as the parity engine's quant pass runs): the
    flip is reported, nothing is set aside, and the logits agree with the reference at the float32 budget
    everywhere, the flipped row included."""
    model, tokens = tiny
    _, calls = _quant_run(model, tokens)
    at = next(i for i, c in enumerate(calls) if c.site == "stack.layers.0.block.self_attn:act")
    row, position = 1, 4
    x_row = calls[at].x[row, position]
    element = int(np.argsort(np.abs(x_row))[len(x_row) // 2])
    below, above = _straddle(x_row, element)
    ref, ref_calls = _quant_run(model, tokens, (at, row, position, element, below))
    unaligned, _ = _quant_run(model, tokens, (at, row, position, element, above))
    got, got_calls = _quant_run(model, tokens, (at, row, position, element, above), align=ref_calls)

    report = compare(ref_calls, got_calls, aligned=True)
    assert report.ok and report.aligned, report.summary()
    (flip,) = report.flips
    assert (flip.call, flip.row, flip.position, flip.index[-1]) == (at, row, position, element)
    assert not report.affected.any()
    assert rel(unaligned, ref) > 10 * F32_REL  # unaligned, the flip reaches the logits ...
    assert rel(got, ref) <= F32_REL  # ... aligned, every position holds the float32 budget


def test_an_aligned_run_still_fails_a_perturbed_weight(tiny):
    """Alignment only takes codes within FLIP_ULPS of a boundary: the ±1e-3 q_proj perturbation below stays a
    divergence and its logits still fail."""
    model, tokens = tiny
    ref, ref_calls = _quant_run(model, tokens)
    bad = _perturbed(model)
    got, got_calls = _quant_run(bad, tokens, align=ref_calls)
    report = compare(ref_calls, got_calls, aligned=True)
    assert not report.ok and report.divergences[0].layer == 1, report.summary()
    assert rel(got, ref) > F32_REL


def test_a_weight_perturbed_beyond_float32_noise_still_fails(tiny):
    """q_proj of layer 1 with each weight moved by ±1e-3 of itself (~10^4 times float32 noise; random signs, since
    a per-row A8 code is blind to a uniform scale): codes move far from any boundary at layer 1's query
    quantiser, a real divergence, not a flip."""
    model, tokens = tiny
    ref, ref_calls = _quant_run(model, tokens)
    bad = _perturbed(model)
    got, got_calls = _quant_run(bad, tokens)

    report = compare(ref_calls, got_calls)
    assert not report.ok, report.summary()
    first = report.divergences[0]
    assert first.layer == 1 and first.site == "stack.layers.1.block.self_attn:qkv"
    assert max(first.margins) > flips.FLIP_ULPS
    assert masked_rel(got, ref, report.affected) > F32_REL  # and the judged logits fail on their own too


def test_the_flax_tracer_sees_the_torch_twins_calls(tiny):
    """The Flax twin traced inside its layer scan makes the same calls in the same order; on these weights no value
    falls within float32 noise of a boundary, so no flip, and the quant logits agree at the float32 budget."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from needle_flax.v3 import SimpleAttentionNetwork as FlaxNetwork

    model, tokens = tiny
    got, got_calls = _quant_run(model, tokens)
    net = FlaxNetwork(TINY)
    params = jax.tree.map(jnp.asarray, convert.random_flax_params(TINY, seed=7, groups=()))
    with jax.default_matmul_precision("highest"), flips.trace_flax() as ref_calls:
        ref = np.asarray(jax.jit(lambda p, t: net.apply({"params": p}, t, quant=True))(params, tokens.numpy()))
    assert [c.x.shape for c in ref_calls] == [c.x.shape for c in got_calls]
    report = compare(ref_calls, got_calls)
    assert report.ok and not report.flips, report.summary()
    assert report.noise <= flips.FLIP_ULPS
    assert masked_rel(got, ref, report.affected) <= F32_REL
