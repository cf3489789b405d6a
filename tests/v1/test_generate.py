"""Greedy generation in both twins: upstream's fixtures, cached == recompute, EOS/padding/suppression, compile-once."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from convert.errors import GenerationError
from convert.mapping import random_flax_params
from convert.v1.config import FIRST_PLAIN_ID, SPECIAL_IDS, TransformerConfig
from needle_flax import generate as flax_generate
from needle_flax import generate_recompute as flax_recompute
from needle_flax.v1.model import make_padding_mask as flax_padding_mask
from needle_flax.v1.model import precompute_rope_freqs as nf_precompute_rope_freqs
from needle_torch import generate as torch_generate
from needle_torch import generate_recompute as torch_recompute
from needle_torch.fast.kernels import CompileFallbackWarning
from needle_torch.v1.generate import pick
from needle_torch.v1.model import make_padding_mask as torch_padding_mask
from parity_tests.metrics import max_rel
from parity_tests.twins import build_twins
from parity_tests.v1.adapter import ADAPTER
from tests.torch_threads import torch_threads

SPECIAL = SPECIAL_IDS  # PAD EOS BOS UNK <tool_call> <tools>: the fixtures' greedy loop never chose these
F32_REL = 1e-5  # float32 twins of one function: ~5e-7 seen; 1e-5 is the project's float32 logits budget
# bf16: 8-bit mantissa (unit roundoff 3.9e-3); through 2+2 layers the twins' bf16 logits sit up to ~1.3e-2
# (relative to max |logit|) from upstream's eagerly computed bf16 goldens, so 3e-2 bounds it with margin.
BF16_REL = 3e-2
# A greedy row is only *determined* by bf16 logits when every step's top-1/top-2 gap exceeds twice the
# largest absolute logit error bf16 can make here (0.025 ~ BF16_REL x max |logit| ~ 1.7).
BF16_DECISIVE_GAP = 2 * 0.025

# A compiled run that fell back to eager past dynamo's recompile limit would test eager code: make it fail.
pytestmark = pytest.mark.filterwarnings("error::needle_torch.fast.kernels.CompileFallbackWarning")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These models are tiny: on shared cores a second torch thread only waits for the first (10-100x slower).

    (float32 parity also needs full-precision matmuls: conftest pins them for the session.)"""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def fixture(golden):
    return golden


@pytest.fixture(scope="module")
def checkpoint(fixture_checkpoint):
    return fixture_checkpoint


class Twins:
    """Both twins of one checkpoint in one compute dtype (parity_tests.twins), and runners with one signature."""

    def __init__(self, params, config: TransformerConfig, dtype: str):
        twins = build_twins(ADAPTER, config, params, dtype)  # upstream casts every param
        self.config, self.flax_model, self.flax_params = twins.config, twins.flax_model, twins.flax_params
        self.torch_model = twins.torch_model

    def run(self, which: str, src: np.ndarray, masked: bool = True, **kw):
        """which: torch-cached/-compiled/-recompute, flax-cached/-recompute; returns numpy (tokens, logits?)."""
        backend, kind = which.split("-")
        if backend == "torch":
            fn = torch_recompute if kind == "recompute" else torch_generate
            if kind == "compiled":  # the cached loop under torch.compile: few-row products become reductions
                kw = {**kw, "compile": True}
            s = torch.from_numpy(np.asarray(src)).long()
            out = fn(self.torch_model, s, torch_padding_mask(s) if masked else None, **kw)
        else:
            fn = flax_generate if kind == "cached" else flax_recompute
            s = jnp.asarray(src, jnp.int32)
            out = fn(self.flax_model, self.flax_params, s, flax_padding_mask(s) if masked else None, **kw)
        if isinstance(out, tuple):
            return tuple(np.asarray(o) for o in out)
        return np.asarray(out)


@pytest.fixture(scope="module")
def f32(checkpoint):
    return Twins(checkpoint.params, checkpoint.config, "float32")


@pytest.fixture(scope="module")
def bf16(checkpoint):
    return Twins(checkpoint.params, checkpoint.config, "bfloat16")


def greedy_steps(fixture) -> int:
    """The decode steps of the fixture's greedy goldens (their first column is the start token)."""
    return fixture["f32/greedy_tokens"].shape[1] - 1


# The compiled tests of the fixture in float32 run in one xdist group (scripts/test.sh: --dist loadgroup) and ask for
# the fixture's 11 steps, so they share one step graph, built once in one worker, instead of one graph per length.
V1_GRAPHS = pytest.mark.xdist_group("torch-v1-compiled")
COMPILED = pytest.param("torch-compiled", marks=V1_GRAPHS)
RUNNERS = ["torch-cached", COMPILED, "torch-recompute", "flax-cached", "flax-recompute"]


# ----------------------------------------------------------------------------- upstream fixtures


@pytest.mark.parametrize("which", RUNNERS)
def test_float32_reproduces_upstream_greedy_tokens_and_step_logits(f32, fixture, which):
    steps = greedy_steps(fixture)
    tokens, logits = f32.run(which, fixture["src"], max_new_tokens=steps, suppress_tokens=SPECIAL,
                             return_logits=True)
    np.testing.assert_array_equal(tokens, fixture["f32/greedy_tokens"])
    # The fixture's step logits are the raw logits (before suppression) each greedy step chose from.
    expected = fixture["f32/greedy_step_logits"]
    for k in range(steps):
        assert max_rel(logits[:, k], expected[:, k]) <= F32_REL, f"step {k}"


@pytest.mark.parametrize("which", RUNNERS)
def test_bfloat16_runs_and_matches_upstream_where_bf16_decides(bf16, fixture, which):
    steps = fixture["bf16/greedy_tokens"].shape[1] - 1
    tokens, logits = bf16.run(which, fixture["src"], max_new_tokens=steps, suppress_tokens=SPECIAL,
                              return_logits=True)
    expected_tokens, expected_logits = fixture["bf16/greedy_tokens"], fixture["bf16/greedy_step_logits"]
    assert tokens.shape == expected_tokens.shape
    assert np.isfinite(logits).all()
    gaps = _top2_gaps(expected_logits, SPECIAL)  # (B,) smallest top-1/top-2 gap over the steps
    decisive = gaps > BF16_DECISIVE_GAP
    assert decisive.any(), "the check would be vacuous: no fixture row is decided beyond bf16 error"
    agree = (tokens == expected_tokens).all(axis=1)
    assert agree[decisive].all(), f"rows {np.flatnonzero(decisive & ~agree)} differ though bf16 cannot flip them"
    # Logits are comparable while a row follows upstream's tokens (the inputs are then the same).
    for r in np.flatnonzero(agree):
        assert max_rel(logits[r], expected_logits[r]) <= BF16_REL, f"row {r}"
    print(f"{which}: {agree.sum()}/{len(agree)} bf16 rows equal upstream's ({decisive.sum()} decided beyond bf16 "
          f"error, gaps {np.round(gaps, 4).tolist()})")


def _top2_gaps(logits: np.ndarray, suppress) -> np.ndarray:
    masked = logits.astype(np.float64).copy()
    masked[..., list(suppress)] = -np.inf
    top2 = np.sort(masked, axis=-1)[..., -2:]  # (B, steps, 2)
    return (top2[..., 1] - top2[..., 0]).min(axis=1)


# ----------------------------------------------------------------------------- cached == recompute


def _tiny_ffn_twins(dtype: str = "float32") -> Twins:
    """A second architecture: FFN on (geglu), MQA, odd sizes; every weight random."""
    config = TransformerConfig(vocab_size=97, d_model=48, num_heads=4, num_kv_heads=1, num_encoder_layers=1,
                               num_decoder_layers=2, d_ff=40, no_feedforward=False, activation="geglu",
                               max_seq_len=32)
    return Twins(random_flax_params(config, seed=3, std=0.2), config, dtype)


def _random_src(config: TransformerConfig, lengths: list[int], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    src = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        src[i, :n] = rng.integers(FIRST_PLAIN_ID, config.vocab_size, n)
    return src


@pytest.mark.parametrize("which", RUNNERS)
def test_without_a_mask_padded_rows_get_upstreams_tokens(f32, fixture, which):
    """No src_mask means the padding mask of src (as upstream's generate builds it): the right-padded fixture rows
    decode to upstream's greedy tokens, which were computed with that mask."""
    steps = greedy_steps(fixture)
    tokens = f32.run(which, fixture["src"], masked=False, max_new_tokens=steps, suppress_tokens=SPECIAL)
    np.testing.assert_array_equal(tokens, fixture["f32/greedy_tokens"])


@pytest.mark.parametrize("backend", ["torch", "flax"])
def test_an_explicit_mask_still_wins(f32, fixture, backend):
    """An all-True mask (attend to the pads too) is taken as given: the padded rows then choose other tokens, so
    the default above is a real choice, not a no-op."""
    src = fixture["src"]
    steps = greedy_steps(fixture)
    everywhere = np.ones((src.shape[0], 1, 1, src.shape[1]), bool)
    if backend == "torch":
        tokens = torch_generate(f32.torch_model, torch.from_numpy(src).long(), torch.from_numpy(everywhere),
                                steps, suppress_tokens=SPECIAL).numpy()
    else:
        tokens = np.asarray(flax_generate(f32.flax_model, f32.flax_params, jnp.asarray(src), jnp.asarray(everywhere),
                                          steps, suppress_tokens=SPECIAL))
    padded = (src == 0).any(axis=1)
    assert padded.sum() == 2  # rows 1 and 2 are right-padded (lengths 11 and 6)
    differs = (tokens != fixture["f32/greedy_tokens"]).any(axis=1)
    assert differs[padded].all() and not differs[~padded].any()


@pytest.mark.parametrize("cached", ["torch-cached", COMPILED, "flax-cached"])
@pytest.mark.parametrize("model", ["fixture", "tiny-ffn-mqa"])
def test_cached_logits_equal_recompute_logits_at_every_step_float32(f32, fixture, cached, model):
    twins, src = (f32, fixture["src"]) if model == "fixture" else (_tiny_ffn_twins(), None)
    if src is None:
        src = _random_src(twins.config, [9, 5, 7])
    steps = greedy_steps(fixture)  # the fixture's length, so the fixture's compiled graph is shared
    kw = dict(max_new_tokens=steps, suppress_tokens=SPECIAL, return_logits=True)
    tokens_c, logits_c = twins.run(cached, src, **kw)
    tokens_r, logits_r = twins.run(cached.split("-")[0] + "-recompute", src, **kw)
    np.testing.assert_array_equal(tokens_c, tokens_r)
    assert logits_c.shape == logits_r.shape == (src.shape[0], steps, twins.config.vocab_size)
    for k in range(steps):
        assert max_rel(logits_c[:, k], logits_r[:, k]) <= F32_REL, f"step {k}"


@pytest.mark.parametrize("backend", ["torch", "flax"])
def test_cached_equals_recompute_in_bfloat16(bf16, fixture, backend):
    kw = dict(max_new_tokens=6, suppress_tokens=SPECIAL, return_logits=True)
    tokens_c, logits_c = bf16.run(f"{backend}-cached", fixture["src"], **kw)
    tokens_r, logits_r = bf16.run(f"{backend}-recompute", fixture["src"], **kw)
    np.testing.assert_array_equal(tokens_c, tokens_r)
    # Same arithmetic in both paths (the cache holds K/V in float32, exactly what recompute feeds attention);
    # only matmul shapes differ, so the gap is far below one bf16 ulp of the logits (2^-8 relative).
    assert max_rel(logits_c, logits_r) <= 2.0**-8


def test_torch_and_flax_choose_identical_tokens_float32_on_random_model():
    twins = _tiny_ffn_twins()
    src = _random_src(twins.config, [11, 4, 8, 6], seed=5)
    tokens_t, logits_t = twins.run("torch-cached", src, max_new_tokens=12, return_logits=True)
    tokens_f, logits_f = twins.run("flax-cached", src, max_new_tokens=12, return_logits=True)
    np.testing.assert_array_equal(tokens_t, tokens_f)
    n = min(logits_t.shape[1], logits_f.shape[1])
    assert max_rel(logits_t[:, :n], logits_f[:, :n]) <= F32_REL


# ----------------------------------------------------------------------------- EOS, padding, suppression


def _expected_with_eos(tokens_no_eos, logits_no_eos, allowed, eos, pad):
    """From a run where EOS was suppressed: rows stop at the first step whose raw logits put EOS first among
    `allowed` (argmax keeps the first index on ties, and EOS has the lowest id), then hold `pad`."""
    B, steps = logits_no_eos.shape[:2]
    out = np.full((B, 1 + steps), pad, np.int64)
    out[:, 0] = eos
    last = 0
    for r in range(B):
        for k in range(steps):
            choice = allowed[int(np.argmax(logits_no_eos[r, k, allowed]))]
            out[r, k + 1] = choice
            if choice == eos:
                break
            assert choice == tokens_no_eos[r, k + 1]
        last = max(last, k + 1)
    return out[:, : 1 + last]


@pytest.mark.parametrize("backend", ["torch", "flax"])
@pytest.mark.parametrize("low", [195, 249])  # 195: rows stop at different steps or run on; 249: all stop early
def test_rows_stop_at_eos_independently_and_pad_after(f32, fixture, backend, low):
    V, eos, pad = f32.config.vocab_size, 1, 7
    allowed = [eos, low, low + 1, low + 2]
    suppress = [i for i in range(V) if i not in allowed]
    tokens_a, logits_a = f32.run(f"{backend}-cached", fixture["src"], max_new_tokens=10,
                                 suppress_tokens=suppress + [eos], pad_token_id=pad, return_logits=True)
    expected = _expected_with_eos(tokens_a, logits_a, allowed, eos, pad)
    assert (expected == eos)[:, 1:].any(), "the case must make EOS win somewhere"
    tokens = f32.run(f"{backend}-cached", fixture["src"], max_new_tokens=10, suppress_tokens=suppress,
                     pad_token_id=pad)
    np.testing.assert_array_equal(tokens, expected)
    if low == 249:
        assert tokens.shape[1] < 11, "all rows stopped, so the loop must end before max_new_tokens"
        return
    for r in range(len(tokens)):  # each row alone decodes the same: rows do not leak into each other
        alone = f32.run(f"{backend}-cached", fixture["src"][r : r + 1], max_new_tokens=10,
                        suppress_tokens=suppress, pad_token_id=pad)
        width = alone.shape[1]
        np.testing.assert_array_equal(alone[0], tokens[r, :width])
        assert (tokens[r, width:] == pad).all()


@pytest.mark.parametrize("which", RUNNERS)
def test_suppressed_tokens_are_never_chosen(f32, fixture, which):
    """Every token the greedy loop chose (with the special ids suppressed) suppressed as well: none is chosen again.
    (The suppressed set is a tensor input, so the compiled runs share the fixture's graph.)"""
    steps = greedy_steps(fixture)
    free = f32.run(which, fixture["src"], max_new_tokens=steps, suppress_tokens=SPECIAL)
    suppress = sorted(set(free[:, 1:].ravel().tolist()) | set(SPECIAL))
    assert len(suppress) > len(SPECIAL) + 3  # the loop's own choices are suppressed, not only the special ids
    tokens = f32.run(which, fixture["src"], max_new_tokens=steps, suppress_tokens=suppress)
    chosen = tokens[:, 1:]
    assert not np.isin(chosen, suppress).any()
    assert chosen.shape == (3, steps)


def test_pick_rule_on_handmade_logits():
    logits = torch.tensor([[0.0, 5.0, 1.0, 1.0], [3.0, 1.0, 2.0, 2.0], [0.0, 9.0, 0.0, 0.0]])
    done = torch.tensor([False, False, True])
    nxt, now_done = pick(logits, done, torch.tensor([True, False, False, False]), eos=1, pad=3)
    assert nxt.tolist() == [1, 2, 3]  # row 0 picks EOS; row 1: 0 suppressed, tie 2/3 -> first; row 2 done -> pad
    assert now_done.tolist() == [True, False, True]


# ----------------------------------------------------------------------------- streaming, API, compile-once


@pytest.mark.parametrize("backend", ["torch", "flax"])
def test_streamer_sees_every_step_in_order(f32, fixture, backend):
    seen = []
    tokens = f32.run(f"{backend}-cached", fixture["src"], max_new_tokens=5, suppress_tokens=SPECIAL,
                     streamer=lambda step: seen.append(np.asarray(step).tolist()))
    assert np.array(seen).T.tolist() == tokens[:, 1:].tolist()


def test_torch_model_generate_method_is_the_cached_loop(f32, fixture):
    src = torch.from_numpy(fixture["src"]).long()
    via_method = f32.torch_model.generate(src, torch_padding_mask(src), max_new_tokens=11, suppress_tokens=SPECIAL)
    assert via_method.dtype == torch.long
    np.testing.assert_array_equal(via_method.numpy(), fixture["f32/greedy_tokens"])


def test_flax_loop_compiles_once_for_all_steps_and_requests(f32, fixture, caplog):
    kw = dict(max_new_tokens=7, suppress_tokens=(0, 2, 3, 4, 5))  # a combination no other test compiles
    with caplog.at_level(logging.DEBUG, logger="jax._src.dispatch"), jax.log_compiles():
        first = f32.run("flax-cached", fixture["src"], **kw)
        n_first = _compilations(caplog, "_cached_loop")
        caplog.clear()
        second = f32.run("flax-cached", fixture["src"][:, ::-1].copy(), **kw)  # same shapes, other tokens
        n_second = _compilations(caplog, "_cached_loop")
    assert first.shape == (3, 8) and not np.array_equal(first, second)
    assert (n_first, n_second) == (1, 0)


def _compilations(caplog, name: str) -> int:
    return sum(f"compilation of jit({name})" in r.getMessage() for r in caplog.records)


def _call(twins: Twins, which: str, src, src_mask=None, **kw):
    """Run one loop with src and src_mask passed exactly as given (lists, numpy, torch or jax arrays)."""
    if which.startswith("torch"):
        fn = torch_recompute if which == "torch-recompute" else torch_generate
        kw = {**kw, "compile": True} if which == "torch-compiled" else kw
        return fn(twins.torch_model, src, src_mask, **kw)
    fn = flax_recompute if which == "flax-recompute" else flax_generate
    return fn(twins.flax_model, twins.flax_params, src, src_mask, **kw)


@pytest.mark.parametrize("which", RUNNERS)
@pytest.mark.parametrize("bad, message", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=None), r"max_new_tokens must be an integer >= 1, got None"),
    (dict(max_new_tokens=-3), r"max_new_tokens must be an integer >= 1, got -3"),
    (dict(max_new_tokens="3"), r"max_new_tokens must be an integer >= 1, got '3'"),
    (dict(suppress_tokens=[512]), "outside the vocabulary"),
    (dict(suppress_tokens=range(512)), "no token can be chosen"),
    (dict(eos_token_id=-1), "eos_token_id"),
    (dict(pad_token_id=10_000), "pad_token_id"),
    (dict(suppress_tokens=[2.5]), "integer token ids"),
    (dict(src=np.full((3, 16), 512)), r"src has ids \[512\] outside the model's vocabulary"),
    # ids no integer dtype holds (int32, int64, even uint64) are out of vocabulary, not an overflow in a conversion
    (dict(src=np.array([[5, 3_000_000_000]])), r"src has ids \[3000000000\] outside"),
    (dict(src=[[5, 3_000_000_000]]), r"src has ids \[3000000000\] outside"),
    (dict(src=[[5, 2**63]]), rf"src has ids \[{2**63}\] outside"),
    (dict(src=[[5, 2**64], [6, -2**70]]), rf"src has ids \[{-2**70}, {2**64}\] outside"),
    (dict(src=np.full((3, 16), 7.0)), "token ids must be int32 or int64"),
    (dict(src=[[7.0, 8.0]]), "src holds float values such as 7.0; token ids must be int32 or int64"),
    (dict(src=[[True, False]]), "src holds bool values such as True; token ids must be int32 or int64"),
    (dict(src=[[5, 6], [7]]), "src is not a rectangular array"),
    (dict(src_mask=np.ones((3, 16), bool)), r"src_mask must be \(batch, 1, 1, 16\)"),
    (dict(src_mask=np.ones((3, 1, 1, 16), np.int32)), "must be bool"),
    (dict(src_mask=[[[[1] * 16]]] * 3), "src_mask holds int64 values; it must be bool"),
])
def test_bad_arguments_name_the_problem(f32, fixture, which, bad, message):
    """Every loop checks through convert.generation, on the arguments as given: the same one-line message."""
    bad = dict(bad)
    src, mask = bad.pop("src", fixture["src"]), bad.pop("src_mask", None)
    kw = {"max_new_tokens": 3, **bad}
    with pytest.raises(GenerationError, match=message) as raised:
        _call(f32, which, src, mask, **kw)
    assert "\n" not in str(raised.value)


NOT_TOKEN_DTYPES = ["int8", "int16", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "bool"]


@pytest.mark.parametrize("form", ["numpy", "native"])  # native: a torch tensor for torch, a jax array for flax
@pytest.mark.parametrize("which", ["torch-cached", "torch-recompute", "flax-cached", "flax-recompute"])
def test_both_twins_take_int32_and_int64_ids_and_refuse_every_other_dtype(f32, fixture, which, form):
    def as_form(a):
        if form == "numpy":
            return a
        return torch.from_numpy(a) if which.startswith("torch") else jnp.asarray(a)

    mask = np.asarray(flax_padding_mask(fixture["src"]))  # (B, 1, 1, S) bool
    for dtype in ("int32", "int64"):
        tokens = _call(f32, which, as_form(fixture["src"].astype(dtype)), mask, max_new_tokens=3,
                       suppress_tokens=SPECIAL)
        np.testing.assert_array_equal(np.asarray(tokens), fixture["f32/greedy_tokens"][:, :4])
    for dtype in NOT_TOKEN_DTYPES:
        src = as_form(fixture["src"].astype(dtype))
        with pytest.raises(GenerationError, match="values; token ids must be int32 or int64"):
            _call(f32, which, src, max_new_tokens=3)


@pytest.mark.parametrize("which", ["torch-cached", "torch-recompute", "flax-cached", "flax-recompute"])
def test_src_and_src_mask_as_lists_equal_arrays(f32, fixture, which):
    src = fixture["src"]
    mask = np.asarray(flax_padding_mask(src))  # (B, 1, 1, S) bool
    kw = dict(max_new_tokens=4, suppress_tokens=SPECIAL)
    as_lists = _call(f32, which, src.tolist(), mask.tolist(), **kw)
    np.testing.assert_array_equal(np.asarray(as_lists), fixture["f32/greedy_tokens"][:, :5])


@pytest.mark.parametrize("backend", ["torch", "flax"])
def test_suppress_tokens_as_arrays_equal_lists(f32, fixture, backend):
    kw = dict(max_new_tokens=4, masked=True)
    as_list = f32.run(f"{backend}-cached", fixture["src"], suppress_tokens=[0, 2, 3, 7], **kw)
    as_array = f32.run(f"{backend}-cached", fixture["src"], suppress_tokens=np.array([0, 2, 3, 7]), **kw)
    np.testing.assert_array_equal(as_array, as_list)


def _dropout_twins() -> Twins:
    config = TransformerConfig(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, num_encoder_layers=1,
                               num_decoder_layers=1, dropout_rate=0.5, max_seq_len=32)
    return Twins(random_flax_params(config, seed=3), config, "float32")


def test_torch_generation_never_applies_dropout_and_leaves_the_mode_alone():
    """Flax generation is deterministic; so is torch's on a model in training mode (dropout 0.5), unchanged."""
    twins = _dropout_twins()
    model = twins.torch_model
    src = torch.from_numpy(_random_src(twins.config, [9, 5])).long()
    expected = torch_generate(model, src, max_new_tokens=6, suppress_tokens=SPECIAL)
    model.train()
    modes = []
    for generate in (torch_generate, torch_recompute):
        out = generate(model, src, max_new_tokens=6, suppress_tokens=SPECIAL,
                       streamer=lambda _: modes.append(model.training))
        torch.testing.assert_close(out, expected)
    assert modes and all(modes) and model.training  # generation never switched the shared model to eval
    flax_tokens = twins.run("flax-cached", src.numpy(), masked=False, max_new_tokens=6, suppress_tokens=SPECIAL)
    np.testing.assert_array_equal(flax_tokens, expected.numpy())


def test_decode_step_applies_no_dropout_in_either_twin():
    """torch's decode_step in training mode equals eval mode exactly, as Flax's decode_step ignores dropout rngs."""
    twins = _dropout_twins()
    model, cfg = twins.torch_model, twins.config
    src = torch.from_numpy(_random_src(cfg, [7, 7], seed=1)).long()
    tokens = torch.from_numpy(_random_src(cfg, [4, 4], seed=2)).long()  # (B, 4) decoder inputs

    def steps():
        enc = model.encode(src, deterministic=True)[0]
        cache = model.new_cache(enc, 4)
        return torch.cat([model.decode_step(tokens[:, t : t + 1], cache, t) for t in range(4)], 1), enc

    with torch.no_grad():
        eval_logits, eval_enc = steps()
        model.train()
        train_logits, train_enc = steps()
        # not vacuous: in training mode this model's encoder and full decode do drop activations
        dropped = model.encode(src, deterministic=False)[0]
        assert not torch.equal(dropped, eval_enc)
        assert not torch.equal(model.decode(tokens, eval_enc, deterministic=False), model.decode(tokens, eval_enc))
        model.eval()
    assert torch.equal(train_enc, eval_enc) and torch.equal(train_logits, eval_logits)

    # Flax: step 0 of the cached decoder with a dropout rng equals the step without one, and torch's step.
    fm, params = twins.flax_model, twins.flax_params
    s = jnp.asarray(src.numpy(), jnp.int32)
    enc = fm.apply({"params": params}, s, None, method="encode")[0]
    rope = tuple(t[:1] for t in nf_precompute_rope_freqs(cfg.head_dim, 4, cfg.rope_theta))
    mask = (jnp.arange(4) <= 0)[None, None, None, :]
    args = (jnp.asarray(tokens[:, :1].numpy(), jnp.int32), enc, mask, None, rope, 0, 4)
    plain, _ = fm.apply({"params": params}, *args, method="decode_step", mutable=["cache"])
    with_rng, _ = fm.apply({"params": params}, *args, method="decode_step", mutable=["cache"],
                           rngs={"dropout": jax.random.PRNGKey(0)})
    np.testing.assert_array_equal(np.asarray(with_rng), np.asarray(plain))
    assert np.shape(plain) == (2, 1, cfg.vocab_size)  # (B, T, V), as torch's decode_step returns
    assert max_rel(np.asarray(plain)[:, 0], eval_logits[:, 0].numpy()) <= F32_REL


@pytest.mark.parametrize("backend", ["torch", "flax"])
def test_one_dimensional_src_is_refused(f32, fixture, backend):
    with pytest.raises(GenerationError, match="batch"):
        f32.run(f"{backend}-cached", fixture["src"][0], masked=False, max_new_tokens=3)


# ----------------------------------------------------------------------------- torch static shapes / torch.compile


def test_torch_tensor_cache_positions_give_the_same_logits_as_int_positions(f32, fixture):
    """The static-shape path (whole cache under a mask, as torch.compile and CUDA graphs need) is the same function."""
    model, src = f32.torch_model, torch.from_numpy(fixture["src"]).long()
    mask = torch_padding_mask(src)
    with torch.inference_mode():
        encoder_out, _ = model.encode(src, mask)
        by_int, by_tensor = model.new_cache(encoder_out, 6), model.new_cache(encoder_out, 6)
        tokens = torch.from_numpy(fixture["f32/greedy_tokens"][:, :6]).long()
        for t in range(6):
            a = model.decode_step(tokens[:, t : t + 1], by_int, t, cross_mask=mask)
            b = model.decode_step(tokens[:, t : t + 1], by_tensor, torch.tensor(t), cross_mask=mask)
            assert max_rel(b, a) <= F32_REL, f"step {t}"
        # the whole prefix at once through the static path equals the step-by-step prefix path
        whole = model.decode_step(tokens, model.new_cache(encoder_out, 6), torch.tensor(0), cross_mask=mask)
        assert max_rel(whole[:, -1], a[:, 0]) <= F32_REL


@pytest.mark.slow
@V1_GRAPHS
def test_torch_compiled_generation_matches_eager_and_compiles_one_graph(f32, fixture):
    from torch._dynamo.utils import counters

    src = torch.from_numpy(fixture["src"]).long()
    mask = torch_padding_mask(src)
    graphs = counters["stats"]["unique_graphs"]
    tokens, logits = torch_generate(f32.torch_model, src, mask, 11, suppress_tokens=SPECIAL, return_logits=True,
                                    compile=True)
    # at most one new graph for all 11 steps (none when another test in this process compiled these shapes)
    assert counters["stats"]["unique_graphs"] - graphs <= 1
    graphs = counters["stats"]["unique_graphs"]
    again = torch_generate(f32.torch_model, src.flip(1), mask.flip(-1), 11, suppress_tokens=SPECIAL, compile=True)
    assert counters["stats"]["unique_graphs"] == graphs  # a second request with the same shapes reuses it
    np.testing.assert_array_equal(tokens.numpy(), fixture["f32/greedy_tokens"])
    assert max_rel(logits, fixture["f32/greedy_step_logits"]) <= F32_REL
    assert again.shape == tokens.shape and not torch.equal(again, tokens)


@pytest.mark.slow
@V1_GRAPHS
def test_compiled_generation_past_the_recompile_limit_runs_eagerly_and_warns(f32, fixture, monkeypatch):
    """A process that has compiled too many variants (new lengths, say) still generates: eagerly, same tokens, and
    says so in one warning naming the cause and the fix."""
    import importlib

    gen = importlib.import_module("needle_torch.v1.generate")
    eager_steps, real = [], gen._step_and_pick

    def spy(*args):
        if not torch.compiler.is_compiling():  # a compiled step runs its graph, never this Python function
            eager_steps.append(args[3])
        return real(*args)

    monkeypatch.setattr(gen, "_step_and_pick", spy)
    src = torch.from_numpy(fixture["src"]).long()
    mask = torch_padding_mask(src)
    with torch._dynamo.config.patch(recompile_limit=1), pytest.warns(CompileFallbackWarning) as caught:
        # three cache lengths: three graphs wanted, one allowed (11 steps first: the group's shared graph)
        for steps in (greedy_steps(fixture), 4, 5):
            compiled = torch_generate(f32.torch_model, src, mask, steps, suppress_tokens=SPECIAL, compile=True)
            np.testing.assert_array_equal(compiled.numpy(), fixture["f32/greedy_tokens"][:, : 1 + steps])
    assert eager_steps, "the limit was never reached, so the fallback went untested"
    messages = {str(w.message) for w in caught if w.category is CompileFallbackWarning}
    assert len(messages) == 1
    (message,) = messages
    assert "recompile limit" in message and "torch._dynamo.config.recompile_limit" in message
    assert "fewer distinct" in message and "\n" not in message
