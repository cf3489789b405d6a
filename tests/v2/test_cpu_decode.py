"""The C++ decoding step (needle_torch.fast.cpu_decode): each kernel against the eager twin's piece, generation through
the kernels against upstream's goldens, and the rule for when a step takes them.

The kernels keep the eager twin's order of operations and its roundings to the compute dtype; only the order of
float32 sums differs (dot products, the Walsh transform's butterflies, the softmax sum). Hence the budgets: float32
pieces within F32_PIECE_REL of eager; bf16 pieces bit for bit except where a float32 sum lands on the other side of
a bf16 rounding, which moves that element by one bf16 ulp and what follows it in the layer by little more.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from convert.io import read_checkpoint
from convert.mapping import random_flax_params
from convert.trees import flatten_tree, unflatten_tree
from convert.v2.config import BOS_ID, FIRST_PLAIN_ID, NEEDLE_V2_PUBLISHED
from needle_torch.fast import cpu_decode, kernels
from needle_torch.fast import v2 as fast_v2
from needle_torch.v2 import SimpleAttentionNetwork
from needle_torch.v2.generate import generate, make_decode_mask
from needle_torch.v2.lanes import rms_unit
from tests.kernel_builds import without_compiler
from tests.torch_threads import torch_threads
from tests.v2.goldens import G, assert_generated, chosen_from

DATA = "tests/data/"
# float32 kernels against eager pieces: the same operations, float32 sums in another order. Measured on these
# models: layers <= 8.4e-7, engram keys <= 3.0e-7, logits <= 2.5e-7 (max|Δ|/max|ref|); 2.4x the largest.
F32_PIECE_REL = 2e-6
# bf16 pieces: a sum that rounds the other way moves an element by one bf16 ulp (<= 2^-7 of its magnitude), and the
# layer's later ops can carry it on. Measured here: every piece bit for bit (0) on these models; one layer of the
# published 27 at 256 cached keys moved one element by 2.8e-3 of the largest. Twice the ulp bound, and a share of
# 2 % of the elements.
BF16_PIECE_REL = 2.0 ** -6
BF16_PIECE_SHARE = 0.02
# the published widths (d_model 512, head dim 64, 4 lanes, engram width 512) at three layers, two engram sites
PUBLISHED_3 = dataclasses.replace(NEEDLE_V2_PUBLISHED, num_layers=3, engram_layers=(0, 2), max_seq_len=64)


@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """The kernels split their products between OpenMP threads (torch's own pool): run them with two."""
    with torch_threads(2):
        yield


def widen(tree, dtype):
    return unflatten_tree({k: np.asarray(v, np.float32).astype(dtype) for k, v in flatten_tree(tree).items()})


MODELS = {}


def model(name: str, dtype) -> SimpleAttentionNetwork:
    """The tiny fixture checkpoint or a random model at the published widths, in float32 or bf16 (built once)."""
    if (name, dtype) not in MODELS:
        if name == "tiny":
            ckpt = read_checkpoint(DATA + "needle-v2-tiny.pkl")
            config, params = ckpt.config, ckpt.params
        else:
            config, params = PUBLISHED_3, random_flax_params(PUBLISHED_3, seed=3, groups=())
        MODELS[name, dtype] = SimpleAttentionNetwork.from_flax(widen(params, dtype), config)
    return MODELS[name, dtype]


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def assert_piece(out: torch.Tensor, ref: torch.Tensor, what: str, bf16: bool) -> None:
    """Within the float32 budget in a float32 model; in a bf16 model within the bf16 one, and for its bf16 outputs
    with few elements off (a float32 output of bf16 values, such as the engram key's rms_unit, moves everywhere when
    one of those values rounds the other way)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    if not bf16:
        assert rel(out, ref) <= F32_PIECE_REL, f"{what}: {rel(out, ref):.3g}"
        return
    assert rel(out, ref) <= BF16_PIECE_REL, f"{what}: {rel(out, ref):.3g}"
    if ref.dtype == torch.bfloat16:
        assert (out != ref).float().mean().item() <= BF16_PIECE_SHARE, what


def prompts_for(config, rows: int, length: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    out = rng.integers(FIRST_PLAIN_ID, config.vocab_size, (rows, length))
    out[:, 0] = BOS_ID
    return torch.from_numpy(out)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("name,rows", [("tiny", 1), ("tiny", 3), ("published-3", 1), ("published-3", 5)])
def test_each_kernel_is_the_eager_piece(name, rows, dtype):
    """One decoding step after a prefill, every piece fed the eager inputs: both engram sites' keys and values,
    each lane layer's new lanes and the K/V it writes at the step's position, and the logits. In bf16 on a CPU with
    AMX tiles, 5 rows take them for every product of bf16 inputs (1 row: the engram values' 4 taps)."""
    check_pieces(model(name, dtype), rows)


@pytest.mark.parametrize("dp", [0, 1], ids=["upcast-loads", "dot-products"])
def test_bf16_products_without_tiles_are_eager_pieces(dp):
    """The bf16 products' other paths at 5 rows, where this CPU would take AMX tiles: 1 the AVX512-BF16 dot products
    alone (CPUs without tiles), 0 float32 multiply-adds on upcast loads (CPUs without bf16 units)."""
    if dp > cpu_decode.product_path(torch.bfloat16):
        pytest.skip(f"no bf16 dot products for the kernels here ({kernels.bf16_path()})")
    check_pieces(model("published-3", ml_dtypes.bfloat16), 5, dp)


@pytest.mark.parametrize("dp", [1, 2], ids=["dot-products", "amx-tiles"])
def test_bf16_steps_on_bf16_units_take_the_kernels_past_max_rows(dp):
    """Where bf16 products run on the CPU's bf16 units, bf16 steps of up to BF16_MAX_ROWS rows run through the
    kernels (float32 ones up to MAX_ROWS), and 17 and BF16_MAX_ROWS rows give eager's pieces on each path the CPU
    has: 1 the AVX512-BF16 dot products (every weight row once for all rows, 4 input rows at a time), 2 AMX tiles
    too (two tiles of input rows; the engram values' 68 and 128 taps in passes of 4 tiles over each block of weight
    rows)."""
    if dp > cpu_decode.product_path(torch.bfloat16):
        units = "AMX tiles" if dp == 2 else "bf16 dot products"
        pytest.skip(f"no {units} for the kernels here ({kernels.bf16_path()})")
    m = model("published-3", ml_dtypes.bfloat16)
    assert cpu_decode.applies(m, cpu_decode.BF16_MAX_ROWS) and not cpu_decode.applies(m, cpu_decode.BF16_MAX_ROWS + 1)
    assert not cpu_decode.applies(model("published-3", np.float32), cpu_decode.MAX_ROWS + 1)
    for rows in (cpu_decode.MAX_ROWS + 1, cpu_decode.BF16_MAX_ROWS):
        check_pieces(m, rows, dp)


def check_pieces(m: SimpleAttentionNetwork, rows: int, dp: int | None = None) -> None:
    """test_each_kernel_is_the_eager_piece's check; dp: the bf16 products' path to force (cpu_decode.Fused.dp)."""
    cfg, W = m.config, m.config.engram_history
    assert cpu_decode.applies(m, rows)
    P = 20
    prompts = prompts_for(cfg, rows, P, seed=rows)
    with torch.inference_mode():
        cache = fast_v2.ready(m, m.new_cache(rows, P + 4), traced=False, fused=True)
        if dp is not None:
            cache.fused.dp = dp
        m.decode_step(prompts, cache, 0)  # eager prefill
        cache.hist[:, W + P] = prompts_for(cfg, rows, 2, seed=9)[:, 1]
        hist, hist_valid = cache.hist[:, P:P + W + 1], cache.valid[:, P:P + W + 1]
        mask = make_decode_mask(torch.arange(P, P + 1), cache.valid[:, W:W + P + 1])  # (B, 1, 1, P + 1)
        cos, sin = cache.rope[0][P:P + 1], cache.rope[1][P:P + 1]

        ek, ev = m._decode_engram(hist, hist_valid, 1)
        fek, fev = cpu_decode.engram(cache.fused, hist, hist_valid)
        bf16 = m.dtype == torch.bfloat16
        assert_piece(fek, rms_unit(ek), "engram keys (rms_unit)", bf16)
        assert_piece(fev, ev, "engram values", bf16)

        lanes = m._embed(prompts[:, :1])[:, :, None, :].expand(rows, 1, cfg.mhc_lanes, cfg.d_model).contiguous()
        for i, layer in enumerate(m.stack.layers):
            sites = [g for g, site in enumerate(cfg.engram_layers) if site == i]
            eager_kv = (cache.k[i].clone(), cache.v[i].clone(), P)
            engram = (rms_unit(ek)[sites[0]:sites[0] + 1], ev[sites[0]:sites[0] + 1], (0,)) if sites else None
            want = layer(lanes, mask, (cos, sin), False, engram, eager_kv, cache.offsets[i])
            out = torch.empty_like(lanes)
            cpu_decode.layer(cache.fused, i, lanes, out, mask.reshape(rows, -1).contiguous(), cos, sin, P,
                             (fek[sites[0]], fev[sites[0]]) if sites else None)
            assert_piece(out, want, f"layer {i}", bf16)
            assert_piece(cache.k[i][:, :, P], eager_kv[0][:, :, P], f"layer {i} K at the step", bf16)
            assert_piece(cache.v[i][:, :, P], eager_kv[1][:, :, P], f"layer {i} V at the step", bf16)
            assert torch.equal(cache.k[i][:, :, :P], eager_kv[0][:, :, :P])  # the prefill's keys left alone
            lanes = want

        want = m._decode_logits(m.stack.final_norm(lanes.mean(dim=2)), cache.logits_weight)
        assert_piece(cpu_decode.logits(cache.fused, lanes), want, "logits", bf16)


@pytest.fixture
def counted(monkeypatch):
    """Counts the decoding steps that ran their layers through the kernels."""
    calls = []
    run = cpu_decode.run_layers
    monkeypatch.setattr(cpu_decode, "run_layers", lambda *a: calls.append(1) or run(*a))
    return calls


@pytest.fixture(scope="module")
def fx():
    return np.load(DATA + "needle-v2-tiny.npz")


@pytest.mark.parametrize("kind", ["dec", "decw", "batch"])
def test_generation_through_the_kernels_gives_upstreams_goldens(fx, counted, kind):
    """compile=True at <= MAX_ROWS rows on CPU: every step after the prefill's choice through the kernels, and
    upstream's greedy tokens, the logits they came from (F32_REL at every step) and, for the left-padded batch,
    the log-probs. decw: kv_window 6, which the kernels' mask carries; batch: three left-padded rows."""
    f32 = model("tiny", np.float32)
    if kind == "batch":
        tokens, logits, logp = generate(f32, fx["batch_prompts"], G, return_logits=True, return_logprobs=True,
                                        compile=True)
        assert_generated(tokens, logits, fx["f32/batch_tokens"], fx["f32/batch_step_logits"], logp,
                         fx["f32/batch_logp"])
    else:
        tokens, logits = generate(f32, fx["dec_prompt"], G, kv_window=6 if kind == "decw" else 0,
                                  return_logits=True, compile=True)
        assert_generated(tokens, logits, fx[f"f32/{kind}_tokens"], chosen_from(fx, kind))
    assert len(counted) == G - 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_windowed_sinks_and_early_stops_through_the_kernels_are_eagers(fx, counted, temperature):
    """A window of 4 with a sink at each row's BOS, an EOS that stops the second row early (pad after it), greedy
    and sampled from a seed: the kernels' steps give eager's tokens, and its logits and log-probs within
    F32_PIECE_REL."""
    f32 = model("tiny", np.float32)
    prompts = fx["batch_prompts"]
    kw = dict(kv_window=4, sink=prompts == BOS_ID, temperature=temperature, seed=5)
    eos = int(generate(f32, prompts, G, eos_token_id=None, **kw)[1, 3])  # the second row's fourth token
    kw.update(eos_token_id=eos, return_logits=True, return_logprobs=True)
    eager = generate(f32, prompts, G, **kw)
    assert (eager[0][1, 4:] == 0).all() and not counted  # stopped and padded, eagerly
    fused = generate(f32, prompts, G, compile=True, **kw)
    assert len(counted) == eager[1].shape[1] - 1
    assert torch.equal(fused[0], eager[0])
    assert rel(fused[1], eager[1]) <= F32_PIECE_REL and rel(fused[2], eager[2]) <= F32_PIECE_REL


def test_a_model_without_engram_sites_steps_through_the_kernels_as_eager(counted):
    """No engram sites (run_layers gets no keys or values, and every layer's site is -1): the published widths at two
    layers, the kernels' steps give eager's tokens and logits within F32_PIECE_REL."""
    cfg = dataclasses.replace(PUBLISHED_3, num_layers=2, engram_layers=())
    m = SimpleAttentionNetwork.from_flax(random_flax_params(cfg, seed=4, groups=()), cfg)
    assert len(m.engrams) == 0 and cpu_decode.applies(m, 2)
    prompts = prompts_for(cfg, 2, 12, seed=4)
    eager = generate(m, prompts, G, eos_token_id=None, return_logits=True)
    fused = generate(m, prompts, G, eos_token_id=None, return_logits=True, compile=True)
    assert len(counted) == G - 1
    assert torch.equal(fused[0], eager[0]) and rel(fused[1], eager[1]) <= F32_PIECE_REL


def test_the_kernels_take_only_plain_cpu_steps_of_few_rows(monkeypatch):
    """applies(): not past MAX_ROWS rows, not with a hook on any module a step runs (a parity tap records through
    one), not with a projection that is not the twin's Linear (a LoRA wrapper), not with a parameter in another
    dtype; and generate(compile=True) then keeps the torch.compile step."""
    m = model("tiny", np.float32)
    assert cpu_decode.applies(m, 1) and cpu_decode.applies(m, cpu_decode.max_rows(m.dtype))
    assert not cpu_decode.applies(m, cpu_decode.max_rows(m.dtype) + 1)
    handle = m.stack.layers[1].tap_u.register_forward_hook(lambda *a: None)
    try:
        assert not cpu_decode.applies(m, 1)
    finally:
        handle.remove()
    assert cpu_decode.applies(m, 1)

    class Wrapped(kernels.Linear):
        pass

    attn = m.stack.layers[0].block.self_attn
    original = attn.q_proj
    wrapped = Wrapped(original.in_features, original.out_features, bias=False)
    wrapped.weight = original.weight
    monkeypatch.setattr(attn, "q_proj", wrapped)
    assert not cpu_decode.applies(m, 1)
    monkeypatch.setattr(attn, "q_proj", original)
    gate = m.stack.layers[0].block.attn_gate
    monkeypatch.setattr(m.stack.layers[0].block, "attn_gate", torch.nn.Parameter(gate.double()))
    assert not cpu_decode.applies(m, 1)


def test_a_width_the_kernels_do_not_take_keeps_the_torch_step():
    """A head dim of 8 is not a whole float vector: applies() says no before building anything."""
    cfg = dataclasses.replace(PUBLISHED_3, d_model=64, attn_dim=64, num_heads=8, num_kv_heads=4, num_layers=1,
                              engram_layers=(0,))
    assert cfg.head_dim == 8
    m = SimpleAttentionNetwork.from_flax(random_flax_params(cfg, seed=0, groups=()), cfg)
    assert not cpu_decode.applies(m, 1)
    assert cpu_decode._defines(m.dtype, cfg) not in cpu_decode._ready


def test_kernels_that_do_not_build_warn_once_and_keep_the_torch_step(monkeypatch):
    """A failed build (here: no compiler) warns once a process and answers False, so compile=True traces instead."""
    without_compiler(monkeypatch, cpu_decode)
    m = model("tiny", np.float32)
    with pytest.warns(kernels.KernelBuildWarning, match="CPU decoding kernels did not build .*no C[+][+] compiler"):
        assert not cpu_decode.applies(m, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu_decode.applies(m, 1)  # tried once a process


@pytest.mark.parametrize("header, sources", [
    ("bf16_dots.h", ("decode_step.cpp",)),
    ("bf16_lanes.h", ("decode_step.cpp",)),
    ("walsh.h", ("decode_step.cpp",)),
])
def test_the_kernels_sources_inline_their_shared_headers(header, sources):
    """The build compiles a string: kernels.cpp_source puts each shared header's text where a kernel's source includes
    it, once each, and leaves no local include behind (the toolchain would not find the file)."""
    csrc = Path(cpu_decode.__file__).with_name("csrc")
    text_of_header = (csrc / header).read_text()
    for name in sources:
        text = kernels.cpp_source(csrc / name)
        assert text.count(text_of_header) == 1, name
        assert not any(line.startswith('#include "') for line in text.splitlines()), name
