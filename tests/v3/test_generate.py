"""Needle 3 cached generation in both twins (needle_torch.v3.generate, needle_flax.v3.generate): upstream's greedy
goldens, cached == recompute at every step (across the sliding window and on rungs), left padding, torch == Flax,
EOS/padding, streaming, sampling, compile-once, bf16 where bf16 decides.

Goldens: `greedy_tokens`/`greedy_logits` of every tests/data/v3/*.npz that has them (README-v3.md:
`greedy_logits[k]` is upstream's `decode_fn(p, buf)[0, P-1+k]`, the full forward on the growing PAD-filled buffer,
run.generate's loop). The recompute loops are that loop; relative error is max|Δ| / max|ref| per step.
The fixture's prompt (9 tokens) + 10 new tokens crosses its sliding window of 8; the batch tests here run 20 + 30
positions on it (local rings of 8 slots wrapped several times, global layers over all 50).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import convert
from convert.errors import GenerationError
from convert.registry import family_named
from convert.v3 import TransformerConfig, ladder_config, ladder_slice
from needle_flax.v3 import SimpleAttentionNetwork as FlaxNetwork
from needle_flax.v3 import generate as flax_generate
from needle_flax.v3.generate import generate_recompute as flax_recompute
from needle_torch.v3 import SimpleAttentionNetwork as TorchNetwork
from needle_torch.v3.generate import generate as torch_generate
from needle_torch.v3.generate import generate_recompute as torch_recompute
from tests.torch_threads import torch_threads
from tests.v3 import goldens

torch.set_float32_matmul_precision("highest")  # float32 parity: no reduced-precision passes
jax.config.update("jax_default_matmul_precision", "highest")  # as upstream's goldens were made

F32_REL = goldens.F32_REL  # 1e-5 per step; measured ≤ 5.0e-7 (goldens), ≤ 6.6e-7 (cached vs recompute)
# bf16: the torch twin's forward sits within 1.5e-2 relative of upstream's jitted bf16 logits (test_torch_model's
# BF16_REL["logits"], a few bf16 ulps at the largest logit); a step is "decided" by bf16 where the golden's top-2
# gap exceeds twice that, and the tokens must agree on the prefix of decided steps.
BF16_REL = 1.5e-2
GREEDY = tuple(n for n in goldens.NAMES if goldens.load(n).has("f32/greedy_tokens"))
FIXTURE = "needle-v3-tiny"
G = 30  # new tokens in the batch tests: 20 + 30 > the fixture's window of 8, within its max_seq_len of 64


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


def torch_model(params: dict, config: TransformerConfig) -> TorchNetwork:
    sd = convert.flax_to_torch(params, config)
    model = TorchNetwork(config, groups=family_named("v3").groups_in(sd, "torch", config))
    model.load_state_dict(sd, strict=True)
    return model.to(getattr(torch, config.dtype)).eval()


def flax_model(params: dict, config: TransformerConfig):
    return FlaxNetwork(config), jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope="module")
def fx():
    g = goldens.load(FIXTURE)
    cfg = g.config_for("float32")
    rng = np.random.default_rng(0)
    rows = [rng.integers(4, cfg.vocab_size, n) for n in (20, 13, 5)]  # 5 tokens < window < 13 < 20
    batch = np.zeros((3, 20), np.int64)
    for i, r in enumerate(rows):
        batch[i, 20 - len(r):] = r
    return {"g": g, "torch": torch_model(g.params, cfg), "flax": flax_model(g.params, cfg), "rows": rows,
            "batch": batch}


def run(fx, twin: str, fn: str, tokens, n: int, return_logits=False, return_logprobs=False, **kw):
    """generate or recompute ("cached" | "recompute") in one twin, as numpy (tokens, *the requested extras).

    Both extras are always asked for and the unrequested dropped: in Flax the return flags select a compilation,
    and every compilation of the loop costs seconds."""
    if twin == "torch":
        f = torch_generate if fn == "cached" else torch_recompute
        out = f(fx["torch"], torch.as_tensor(np.asarray(tokens)), n, return_logits=True, return_logprobs=True, **kw)
    else:
        f = flax_generate if fn == "cached" else flax_recompute
        out = f(*fx["flax"], np.asarray(tokens), n, return_logits=True, return_logprobs=True, **kw)
    tokens, logits, logp = (np.asarray(o) for o in out)
    return (tokens, *([logits] if return_logits else []), *([logp] if return_logprobs else []))


def step_rel(a, ref) -> float:
    """The worst per-step max|Δ| / max|ref| over (B, steps, V) logits."""
    return max(goldens.rel(a[:, k], ref[:, k]) for k in range(ref.shape[1]))


TWINS = ("torch", "flax")


# ----------------------------------------------------------------------------- upstream's goldens


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("name", GREEDY)
def test_cached_generate_gives_upstreams_greedy_tokens_and_logits(twin, name):
    """Every golden with greedy_*: the tokens exactly, each step's logits within 1e-5 (no EOS in the goldens:
    eos_token_id=None decodes all of them as upstream's loop did)."""
    g = goldens.load(name)
    cfg = g.config_for("float32")
    model = {"g": g, twin: torch_model(g.params, cfg) if twin == "torch" else flax_model(g.params, cfg)}
    ref_tokens, ref_logits = g.arrays["f32/greedy_tokens"], g.arrays["f32/greedy_logits"]
    tokens, logits = run(model, twin, "cached", g.arrays["prompt"], ref_tokens.shape[1], return_logits=True,
                         eos_token_id=None)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert step_rel(logits, ref_logits) <= F32_REL


WINDOW = np.load(goldens.DATA / "needle-v3-tiny.window.npz")  # tools/upstream_goldens.py window_goldens()


@pytest.mark.parametrize("twin", ["torch", pytest.param("flax", marks=pytest.mark.slow)])
def test_a_kv_window_with_sinks_decodes_as_upstreams_windowed_forward(twin, fx):
    """upstream's greedy loop with hidden_cells' window (5, inside the sliding window of 8) and sinks (the first 3
    positions) as the forward's mask: the cached decoder's tokens exactly, each step's logits within 1e-5."""
    ref_tokens, ref_logits = WINDOW["f32/tokens"], WINDOW["f32/logits"]
    tokens, logits = run(fx, twin, "cached", WINDOW["prompt"], ref_tokens.shape[1], return_logits=True,
                         eos_token_id=None, kv_window=int(WINDOW["kv_window"]), sink=WINDOW["sink"])
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert step_rel(logits, ref_logits) <= F32_REL


def test_the_model_method_is_the_cached_loop_and_greedy_by_default(fx):
    g = fx["g"]
    tokens = fx["torch"].generate(torch.as_tensor(g.arrays["prompt"]), max_new_tokens=10)
    assert tokens.shape == (1, 10) and tokens.dtype == torch.long
    np.testing.assert_array_equal(tokens.numpy(), g.arrays["f32/greedy_tokens"])
    flax_tokens = flax_generate(*fx["flax"], g.arrays["prompt"], max_new_tokens=10)  # (B, N) int32
    np.testing.assert_array_equal(np.asarray(flax_tokens), g.arrays["f32/greedy_tokens"])


@pytest.mark.parametrize("twin", TWINS)
def test_bfloat16_tokens_are_upstreams_where_bf16_decides(twin, fx):
    g = fx["g"]
    cfg, params = g.config_for("bfloat16"), g.params_for("bfloat16")
    model = {"g": g, twin: torch_model(params, cfg) if twin == "torch" else flax_model(params, cfg)}
    ref_tokens, ref_logits = g.arrays["bf16/greedy_tokens"], g.arrays["bf16/greedy_logits"]
    top2 = np.sort(ref_logits[0], axis=-1)[:, -2:]
    budget = BF16_REL * np.abs(ref_logits).max()
    decided = np.cumprod((top2[:, 1] - top2[:, 0]) > 2 * budget).astype(bool)  # (G,): the prefix bf16 decides
    assert decided.sum() >= 3, "the check would be nearly vacuous"
    tokens, logits = run(model, twin, "cached", g.arrays["prompt"], ref_tokens.shape[1], return_logits=True,
                         eos_token_id=None)
    assert np.isfinite(logits).all()
    np.testing.assert_array_equal(tokens[0, decided], ref_tokens[0, decided])


# ----------------------------------------------------------------------------- cached == recompute


@pytest.mark.parametrize("twin, layers", [("torch", None), ("torch", 3), ("torch", 2), ("flax", None), ("flax", 3)])
def test_cached_equals_recompute_at_every_step_across_the_window_and_on_rungs(twin, layers, fx):
    """The left-padded batch, 20 + 30 positions (several laps of the local rings); layers=d against the forward's
    subnetwork_only logits of rung d (Flax: one rung, each compilation costs seconds; the code path is the same)."""
    kw = dict(return_logits=True, eos_token_id=None, layers=layers)
    tokens, logits = run(fx, twin, "cached", fx["batch"], G, **kw)
    ref_tokens, ref_logits = run(fx, twin, "recompute", fx["batch"], G, **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert step_rel(logits, ref_logits) <= F32_REL


@pytest.mark.parametrize("twin", TWINS)
def test_a_left_padded_batch_decodes_each_row_as_it_decodes_alone(twin, fx):
    tokens, logits = run(fx, twin, "cached", fx["batch"], G, return_logits=True, eos_token_id=None)
    for i, row in enumerate(fx["rows"]):
        alone, alone_logits = run(fx, twin, "cached", row[None], G, return_logits=True, eos_token_id=None)
        np.testing.assert_array_equal(alone[0], tokens[i])
        assert step_rel(alone_logits, logits[i:i + 1]) <= F32_REL


def test_torch_and_flax_choose_the_same_tokens_in_float32(fx):
    for layers in (None, 3):
        kw = dict(eos_token_id=None, layers=layers)
        np.testing.assert_array_equal(run(fx, "torch", "cached", fx["batch"], G, **kw)[0],
                                      run(fx, "flax", "cached", fx["batch"], G, **kw)[0])


@pytest.mark.parametrize("twin", TWINS)
def test_a_rung_decodes_as_its_sliced_model(twin, fx):
    """layers=d on the full model == the full generate of ladder_config/ladder_slice's rung-d model."""
    g, d = fx["g"], 3
    cfg = g.config_for("float32")
    sub_cfg, sub_params = ladder_config(cfg, d), ladder_slice(g.params, cfg, d)
    sliced = {twin: torch_model(sub_params, sub_cfg) if twin == "torch" else flax_model(sub_params, sub_cfg)}
    kw = dict(return_logits=True, eos_token_id=None)
    tokens, logits = run(fx, twin, "cached", fx["batch"], G, layers=d, **kw)
    ref_tokens, ref_logits = run(sliced, twin, "cached", fx["batch"], G, **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert step_rel(logits, ref_logits) <= F32_REL


RANDOM_CONFIGS = {  # what the fixture does not cover: non-flash, MQA, out_vocab, no taps, no window, 3 orders
    "noflash-mqa-outvocab-noengram": dict(vocab_size=97, d_model=32, num_heads=4, num_kv_heads=1, num_layers=3,
                                          qk_head_dim=8, v_head_dim=12, sliding_window=4, global_layers=(1,),
                                          qkv_conv_taps=2, engram_layers=(), out_vocab=80, flash=False,
                                          mhc_lanes=2),
    "notaps-nowindow-orders234": dict(vocab_size=101, d_model=32, num_heads=2, num_kv_heads=2, num_layers=2,
                                      qk_head_dim=16, v_head_dim=16, sliding_window=0, global_layers=(),
                                      qkv_conv_taps=0, engram_layers=(0,), engram_orders=(2, 3, 4),
                                      engram_slots=37, mhc_lanes=3),
}


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("name", list(RANDOM_CONFIGS))
def test_cached_equals_recompute_on_other_configs(twin, name):
    """Random models (std 0.2), sampled hot with one seed (both loops draw the same noise) so the fed tokens vary."""
    cfg = TransformerConfig(max_seq_len=40, dtype="float32", **RANDOM_CONFIGS[name])
    params = convert.random_flax_params(cfg, seed=sum(map(ord, name)), std=0.2, groups=())
    model = {twin: torch_model(params, cfg) if twin == "torch" else flax_model(params, cfg)}
    prompts = np.array([[0, 0, 5, 9, 11, 3, 7, 2], [4, 8, 15, 16, 23, 42, 6, 9]])
    kw = dict(return_logits=True, eos_token_id=None, temperature=5.0, seed=3)
    tokens, logits = run(model, twin, "cached", prompts, 20, **kw)
    ref_tokens, ref_logits = run(model, twin, "recompute", prompts, 20, **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert len(np.unique(tokens)) > 5, "hot sampling should vary the fed tokens"
    assert logits.shape[-1] == cfg.output_vocab
    assert step_rel(logits, ref_logits) <= F32_REL


# ----------------------------------------------------------------------------- the contract


@pytest.mark.parametrize("twin", TWINS)
def test_rows_stop_at_eos_independently_and_pad_after(twin, fx):
    free, = run(fx, twin, "cached", fx["batch"], G, eos_token_id=None)
    eos = int(free[1, 3])  # row 1 stops at its first occurrence; rows that never choose it run to the end
    expected = free.copy()
    for r in range(3):
        hits = np.flatnonzero(free[r] == eos)
        if hits.size:
            expected[r, hits[0] + 1:] = 0
    tokens, logp = run(fx, twin, "cached", fx["batch"], G, eos_token_id=eos, return_logprobs=True)
    np.testing.assert_array_equal(tokens[:, :logp.shape[1]], expected[:, :logp.shape[1]])
    assert (tokens[:, logp.shape[1]:] == 0).all()
    stop = np.flatnonzero(free[1] == eos)[0]
    assert (logp[1, stop + 1:] == 0).all() and (logp[1, :stop + 1] != 0).all()
    rec, = run(fx, twin, "recompute", fx["batch"], G, eos_token_id=eos)
    np.testing.assert_array_equal(rec, tokens)


@pytest.mark.parametrize("twin", TWINS)
def test_the_loop_ends_once_every_row_has_stopped(twin, fx):
    g = fx["g"]
    eos = int(g.arrays["f32/greedy_tokens"][0, 0])  # the first token: one step, the rest padding
    tokens, logits = run(fx, twin, "cached", g.arrays["prompt"], 10, eos_token_id=eos, return_logits=True)
    assert tokens.tolist() == [[eos] + [0] * 9] and logits.shape[:2] == (1, 1)


def test_the_torch_streamer_sees_every_step_in_order(fx):
    seen = []
    tokens, = run(fx, "torch", "cached", fx["batch"], 7, eos_token_id=None, streamer=lambda t: seen.append(t.numpy()))
    assert np.stack(seen, axis=1).tolist() == tokens.tolist()


@pytest.mark.parametrize("twin", TWINS)
def test_sampling_is_seeded_reproducible_and_shared_with_the_recompute_loop(twin, fx):
    kw = dict(eos_token_id=None, temperature=2.0)
    a, = run(fx, twin, "cached", fx["batch"], 12, seed=7, **kw)
    b, = run(fx, twin, "cached", fx["batch"], 12, seed=7, **kw)
    c, = run(fx, twin, "cached", fx["batch"], 12, seed=8, **kw)
    ref, = run(fx, twin, "recompute", fx["batch"], 12, seed=7, **kw)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, ref)
    assert not np.array_equal(a, c)


def test_one_flax_compilation_serves_every_step_and_every_request_of_a_shape_and_streams(fx, caplog):
    """The whole loop is one jit: the first request compiles it once (11 new tokens and a streamer: a shape and
    flags no other test uses), a second with other prompt ids, EOS id and streamer compiles nothing; the
    streamer sees every step in order."""
    seen = []
    with caplog.at_level(logging.DEBUG, logger="jax._src.dispatch"), jax.log_compiles():
        first = flax_generate(*fx["flax"], fx["batch"], 11, eos_token_id=None, streamer=seen.append)
        n_first = _compilations(caplog, "_cached_loop")
        caplog.clear()
        second = flax_generate(*fx["flax"], fx["batch"][::-1].copy(), 11, eos_token_id=int(np.asarray(first)[0, 2]),
                               streamer=lambda step: None)
        n_second = _compilations(caplog, "_cached_loop")
    assert (n_first, n_second) == (1, 0)
    assert np.stack(seen, axis=1).tolist() == np.asarray(first).tolist()
    assert not np.array_equal(np.asarray(first), np.asarray(second))


def _compilations(caplog, name: str) -> int:
    return sum(f"compilation of jit({name})" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("bad, message", [
    (dict(layers=1), "not a ladder rung"),
    (dict(layers=6), "not a ladder rung"),
    (dict(kv_window=0), "kv_window must be"),
    (dict(sink=np.ones((2, 20), bool)), "sink"),
    (dict(max_new_tokens=60), "exceed the model's max_seq_len"),
])
def test_bad_arguments_name_the_problem(twin, fx, bad, message):
    kw = {"max_new_tokens": 4, **bad}
    n = kw.pop("max_new_tokens")
    with pytest.raises(GenerationError, match=message):
        run(fx, twin, "cached", fx["batch"], n, **kw)


@pytest.mark.parametrize("twin", TWINS)
def test_a_kv_window_that_holds_the_buffer_changes_nothing(twin, fx):
    """kv_window bounds only the global layers' ring, and only where the buffer is longer (default:
    config.effective_kv_window, 160 here, over 50 positions)."""
    assert fx["g"].config.effective_kv_window >= 20 + G
    a, = run(fx, twin, "cached", fx["batch"], G, eos_token_id=None)
    b, = run(fx, twin, "cached", fx["batch"], G, eos_token_id=None, kv_window=20 + G)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("twin", TWINS)
def test_a_kv_window_shorter_than_the_buffer_windows_the_global_layers(twin, fx):
    """kv_window = the sliding window on the fixture (8 < 50 positions): every layer then sees the last 8
    positions, which is the same weights with no global layers under the same windowed mask."""
    g = fx["g"]
    cfg = g.config_for("float32")
    all_local = dataclasses.replace(cfg, global_layers=())
    windowed = {twin: torch_model(g.params, all_local) if twin == "torch" else flax_model(g.params, all_local)}
    kw = dict(return_logits=True, eos_token_id=None, kv_window=cfg.sliding_window)
    tokens, logits = run(fx, twin, "cached", fx["batch"], G, **kw)
    ref_tokens, ref_logits = run(windowed, twin, "recompute", fx["batch"], G, **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert step_rel(logits, ref_logits) <= F32_REL


def first_valid(batch, n: int) -> np.ndarray:
    """(B, P) bool: each row's first n valid prompt positions (its BOS and what follows), the sinks."""
    valid = np.cumsum(np.asarray(batch) != 0, axis=1)  # the fixture's rows have no pad after their first token
    return (valid >= 1) & (valid <= n)


@pytest.mark.parametrize("twin, kv_window", [("torch", 12), ("torch", 5), ("flax", 12)])
def test_sinks_stay_visible_past_the_kv_window(twin, kv_window, fx):
    """Upstream's window and sinks (`hidden_cells`: causal ∧ valid ∧ (q - k < window ∨ k a sink)) over 50 positions:
    the cached decoder (global rings of kv_window slots plus a sink store) equals the forward under that mask at
    every step. kv_window 12 lies past the sliding window of 8 (global layers only); 5 lies inside it and inside the
    engram's history of 11, so local layers, conv taps and engram rows read the window too. Flax: one case (each
    compilation costs seconds)."""
    sink = first_valid(fx["batch"], 3)
    kw = dict(return_logits=True, eos_token_id=None, kv_window=kv_window, sink=sink)
    tokens, logits = run(fx, twin, "cached", fx["batch"], G, **kw)
    ref_tokens, ref_logits = run(fx, twin, "recompute", fx["batch"], G, **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert step_rel(logits, ref_logits) <= F32_REL
    _, no_sinks = run(fx, twin, "recompute", fx["batch"], G, **{**kw, "sink": None})
    assert step_rel(no_sinks, ref_logits) > 1e-2  # the sinks change the function: the check above could fail


def test_sinks_inside_the_kv_window_change_nothing(fx):
    """A buffer the kv window holds sees every position anyway: sinks or not, the unwindowed decoding."""
    sink = first_valid(fx["batch"], 3)
    a, = run(fx, "torch", "cached", fx["batch"], G, eos_token_id=None, kv_window=20 + G, sink=sink)
    b, = run(fx, "torch", "recompute", fx["batch"], G, eos_token_id=None)
    np.testing.assert_array_equal(a, b)


def test_deploy_numerics_decode_as_the_quantised_forward(fx):
    """quant=True (a .cact's A8 activations and q, the KV cache at kv_bits): the cached decoder against the
    quantised forward's loop. The prefill step within 1e-5 (the same arithmetic); after it only the tokens, since
    float32 noise that crosses an A8 rounding boundary moves a value by one 8-bit step (1/127 of its row's max):
    measured up to 4.2e-3 relative on later steps, the same order as quantisation itself (1.1e-2 at step 0)."""
    kw = dict(return_logits=True, eos_token_id=None, quant=True)
    tokens, logits = run(fx, "torch", "cached", fx["batch"], G, **kw)
    ref_tokens, ref_logits = run(fx, "torch", "recompute", fx["batch"], G, **kw)
    np.testing.assert_array_equal(tokens, ref_tokens)
    assert goldens.rel(logits[:, 0], ref_logits[:, 0]) <= F32_REL
    _, plain = run(fx, "torch", "recompute", fx["batch"], 1, return_logits=True, eos_token_id=None)
    assert goldens.rel(plain[:, 0], ref_logits[:, 0]) > 1e-3  # quant=True reached the numerics
