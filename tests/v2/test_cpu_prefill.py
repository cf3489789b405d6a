"""The C++ prefill attention (needle_torch/fast/cpu_prefill.py) against the twin's own attention
(model.dot_product_attention: SDPA in float32, the explicit bf16 flash attention on the upcast path),
against a float64 numpy attention, and inside compiled prefills against upstream's goldens: float32 and bf16, causal,
left pads, windows with sinks."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from convert.io import read_checkpoint
from convert.trees import flatten_tree, unflatten_tree
from needle_torch.fast import cpu_prefill, kernels
from needle_torch.fast import v2 as fast_v2
from needle_torch.fast.seam import fast_paths
from needle_torch.v2 import model as v2_model
from needle_torch.v2.generate import make_decode_mask
from needle_torch.v2.model import SimpleAttentionNetwork, dot_product_attention
from tests.kernel_builds import assert_warns_once, recording_builds, without_compiler
from tests.v2.goldens import F32_REL

# float32: the same logits, weights and products as SDPA's, summed in another order and normalised after p·v rather
# than before: measured 2.4-4.8e-7 of the largest output (O(1) values, up to a few hundred keys).
KERNEL_REL = 1e-6
# bf16: the same float32 logits and softmax as the eager bf16 flash path, the weights and outputs rounded to bf16 at
# the same places; only the order of the float32 sums differs, which can move a value across a bf16 rounding
# boundary: one bf16 ulp at the largest output, in at most 0.1 % of the outputs (measured 0: bit for bit on these
# cases; the weights left unrounded move 35-40 % of them).
BF16_ULP_REL = 2.0 ** -8
BF16_OFF = 1e-3
CPU = torch.device("cpu")
DATA = "tests/data/"


def inputs(B: int, H: int, K: int, T: int, S: int, h: int, seed: int, pads=(), window: int = 0, sinks: int = 0):
    """q (B, H, T, h); k, v (B, K, S, h) as a cache's prefix (views of (B, K, S + 7, h) buffers, so their rows are
    not contiguous in S); the decode mask (B, 1, T, S) of a prefill at position S - T: causal, each row's first
    pads[b] keys invalid (and their queries, if any, seeing no key), a window of `window` keys with the first
    `sinks` keys pinned."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, h, generator=g)
    k = torch.randn(B, K, S + 7, h, generator=g)[:, :, :S]
    v = torch.randn(B, K, S + 7, h, generator=g)[:, :, :S]
    valid = torch.ones(B, S, dtype=torch.bool)
    for b, p in enumerate(pads):
        valid[b, :p] = False
    sink = None
    if sinks:
        sink = torch.zeros(B, S, dtype=torch.bool)
        sink[:, :sinks] = True
    mask = make_decode_mask(torch.arange(S - T, S), valid, window, sink)  # (B, 1, T, S)
    for b, p in enumerate(pads):  # the pad queries see no key at all (the decode mask lets each see itself)
        mask[b, :, :max(0, p - (S - T))] = False
    return q, k, v, mask


def numpy_attention(q, k, v, mask) -> np.ndarray:
    """float64 softmax(q·kᵀ/√h masked)·v, GQA with consecutive query heads per kv head; rows with no key: NaN."""
    q, k, v, m = (x.double().numpy() for x in (q, k, v, mask))
    G = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    s = np.where(m > 0, s, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - s.max(-1, keepdims=True))
        return (p / p.sum(-1, keepdims=True)) @ v


def rel(a: torch.Tensor, ref) -> float:
    ref = torch.as_tensor(ref, dtype=torch.float64)
    return float((a.double() - ref).abs().max() / ref.abs().max())


CASES = {  # (B, H, K, T, S, h, pads, window, sinks)
    "published heads, 3 blocks and a tail": (2, 8, 4, 80, 80, 64, (0, 37), 0, 0),
    "after earlier tokens, a window with sinks": (2, 4, 2, 70, 75, 16, (3, 0), 24, 2),
    "one kv head per query head, one block": (1, 2, 2, 20, 20, 32, (), 0, 0),
}


@pytest.fixture
def upcast(monkeypatch):
    """This process's bf16 products through the upcast path (a CPU without bf16 units), whatever the CPU."""
    monkeypatch.setattr(kernels, "_native_bf16", lambda: False)


# The bf16 kernel's two forms: float32 multiply-adds on widened values (dp 0), and the CPU's AVX512-BF16 dot products
# (dp 1), which only a CPU that has them can run (elsewhere the instructions would fault).
HAS_DOTS = "avx512_bf16" in kernels.cpu_flags()
DOTS = pytest.mark.parametrize("dots", [False, pytest.param(True, marks=pytest.mark.skipif(
    not HAS_DOTS, reason="the CPU has no AVX512-BF16 dot products"))])


@pytest.mark.parametrize("case", list(CASES))
def test_the_kernel_is_the_twins_attention(case):
    """The kernel against model.dot_product_attention (eager, causal) and float64 numpy where a query sees any key;
    the fully masked queries of a left-padded row stay finite (the kernel averages its block's keys, SDPA all)."""
    B, H, K, T, S, h, pads, window, sinks = CASES[case]
    q, k, v, mask = inputs(B, H, K, T, S, h, seed=len(case), pads=pads, window=window, sinks=sinks)
    cpu_prefill.prepare(H // K, h, torch.float32, CPU)
    bias = torch.zeros(mask.shape).masked_fill_(~mask, v2_model.F32_MIN)
    with torch.no_grad():
        out = cpu_prefill.attend(q, k, v, bias, fast_v2.QUERY_BLOCK)
        ref = dot_product_attention(q, k, v, mask, True, causal=True)
    assert out.shape == ref.shape == q.shape and out.dtype == torch.float32
    assert bool(out.isfinite().all()) and bool(ref.isfinite().all())
    seen = mask[:, 0].any(-1)  # (B, T): queries with at least one key
    assert bool((~seen).any()) == any(p > S - T for p in pads)  # pad queries in the prefill: none seeing a key
    exact = numpy_attention(q, k, v, mask)
    for b in range(B):
        assert rel(out[b][:, seen[b]], ref[b][:, seen[b]]) <= KERNEL_REL, f"row {b}"
        assert rel(out[b][:, seen[b]], exact[b][:, seen[b].numpy()]) <= KERNEL_REL, f"row {b}"


@DOTS
@pytest.mark.parametrize("case", list(CASES))
def test_the_bf16_kernel_is_the_twins_bf16_flash_attention(case, dots, upcast, monkeypatch):
    """bf16, both forms of the kernel (dots: the AVX512-BF16 dot products; else float32 multiply-adds on widened
    values): the kernel against model.dot_product_attention's eager bf16 flash attention (float32
    logits and softmax of the bf16 q, k; weights rounded to bf16; p·v rounded once) within one bf16 ulp, and against
    float64 numpy on the same bf16 values within the two roundings' bound: each weight off by at most 2⁻⁹ of itself
    (so the sum by 2⁻⁹·max|v|), the output by 2⁻⁹ of itself, plus float32's 1e-5·max|v| for the rest. Queries that
    see no key are left out: a causal prefill has none (pad queries see themselves), and the eager path averages
    such a query over all keys where the kernel, like the float32 blocks, averages over its block's."""
    B, H, K, T, S, h, pads, window, sinks = CASES[case]
    q, k, v, mask = (x.bfloat16() if x.is_floating_point() else x
                     for x in inputs(B, H, K, T, S, h, seed=len(case), pads=pads, window=window, sinks=sinks))
    monkeypatch.setattr(cpu_prefill, "_dots", lambda: dots)
    cpu_prefill.prepare(H // K, h, torch.bfloat16, CPU)
    bias = torch.zeros(mask.shape).masked_fill_(~mask, v2_model.FLASH_NEG)
    with torch.no_grad():
        out = cpu_prefill.attend(q, k, v, bias, fast_v2.QUERY_BLOCK)
        ref = dot_product_attention(q, k, v, mask, True, causal=True)
    assert out.shape == ref.shape == q.shape and out.dtype == ref.dtype == torch.bfloat16
    seen = mask[:, 0].any(-1)  # (B, T)
    exact = torch.from_numpy(numpy_attention(q, k, v, mask))
    for b in range(B):
        got, want, x = out[b][:, seen[b]], ref[b][:, seen[b]], exact[b][:, seen[b]]
        assert rel(got, want) <= BF16_ULP_REL, f"row {b}"
        assert float((got != want).float().mean()) <= BF16_OFF, f"row {b}"
        vmax = float(v[b].double().abs().max())
        bound = 2.0 ** -9 * (vmax + x.abs()) + 1e-5 * vmax
        assert bool(((got.double() - x).abs() <= bound).all()), f"row {b}"


def compiled_fixture_prefill(monkeypatch, np_dtype, dtype: torch.dtype):
    """The tiny fixture's model (its float16 tree widened to float32, then rounded once to np_dtype) prefilling
    dec_prompt in a compiled graph with the kernel of `dtype` built and its calls recorded: (goldens, config, logits,
    each call's T)."""
    ckpt = read_checkpoint(DATA + "needle-v2-tiny.pkl")
    g = np.load(DATA + "needle-v2-tiny.npz")
    tree = {k: np.asarray(v, np.float32).astype(np_dtype) for k, v in flatten_tree(ckpt.params).items()}
    model = SimpleAttentionNetwork.from_flax(unflatten_tree(tree), ckpt.config)
    cfg = ckpt.config
    group = cfg.num_heads // cfg.num_kv_heads
    cpu_prefill.prepare(group, cfg.head_dim, dtype, CPU)
    key = cpu_prefill._key(group, cfg.head_dim, dtype)
    calls = []
    real = cpu_prefill._built[key]
    monkeypatch.setattr(cpu_prefill, "_built", {key: lambda *a: (calls.append(a[7]), real(*a))})
    prompts = torch.from_numpy(g["dec_prompt"]).long()
    with torch.no_grad(), fast_paths(model):
        cache = model.new_cache(prompts.shape[0], prompts.shape[1] + 1)
        torch._dynamo.reset()
        logits = torch.compile(lambda p, c: model.decode_step(p, c, 0), fullgraph=True)(prompts, cache)
    return g, cfg, logits, calls


def test_a_compiled_prefill_calls_the_kernel_and_reproduces_upstreams_prefill(monkeypatch):
    """The compiled float32 prefill of the tiny fixture (head dim 16, two query heads per kv head) with the kernel
    built: the op is in the graph, and every position's logits are upstream's forward_cached goldens within the
    twin's float32 budget. Eager code, bf16, a non-causal mask and a graph that records gradients keep SDPA."""
    g, cfg, logits, calls = compiled_fixture_prefill(monkeypatch, np.float32, torch.float32)
    assert calls == [g["dec_prompt"].shape[1]] * cfg.num_layers  # T = the prompt's length, once per layer
    for p in range(logits.shape[1]):
        assert rel(logits[:, p], g["f32/dec_prefill_logits"][:, p]) <= F32_REL, f"prefill position {p}"
    q, k, v, mask = inputs(1, 4, 2, 9, 9, 16, seed=0)
    assert not cpu_prefill.applies(q, k, True)  # not compiling
    monkeypatch.setattr(kernels, "compiling_for_cpu", lambda device: True)
    with torch.no_grad():
        assert cpu_prefill.applies(q, k, True)
        assert cpu_prefill.applies(q, k, True, flash=False)  # float32: upstream's two paths are one function
        assert not cpu_prefill.applies(q, k, False)
        monkeypatch.setattr(kernels, "_native_bf16", lambda: True)
        monkeypatch.setattr(cpu_prefill, "_dots", lambda: False)
        assert not cpu_prefill.applies(q.bfloat16(), k.bfloat16(), True)  # AMX tiles: SDPA's fused bf16 kernel
        monkeypatch.setattr(cpu_prefill, "_dots", lambda: True)
        assert cpu_prefill.applies(q.bfloat16(), k.bfloat16(), True)  # bf16 dot products: the kernel's
    with torch.enable_grad():
        assert not cpu_prefill.applies(q, k, True)  # the op has no backward


@DOTS
def test_a_compiled_bf16_prefill_calls_the_kernel_and_keeps_upstreams_logits(monkeypatch, dots):
    """The compiled bf16 prefill of the tiny fixture (head dim 16), on the upcast path (no bf16 units) and on the
    native one with the AVX512-BF16 dot products, calls the bf16 kernel once per layer, and its last position's
    logits are upstream's first bf16 run-loop logits within the budget the eager bf16 twin is held to there (1.1 x
    the fixture's eager-vs-jit gap, abs: this twin is upstream's eager bf16 pass). bf16's other attention path
    (non-flash, f32 output) keeps the torch form."""
    monkeypatch.setattr(kernels, "_native_bf16", lambda: dots)
    monkeypatch.setattr(cpu_prefill, "_dots", lambda: dots)
    g, cfg, logits, calls = compiled_fixture_prefill(monkeypatch, ml_dtypes.bfloat16, torch.bfloat16)
    budget = 1.1 * json.loads(str(g["meta_json"]))["checks"]["bf16_eager_vs_scan_logits"]
    assert calls == [g["dec_prompt"].shape[1]] * cfg.num_layers
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    err = float(np.abs(logits[0, -1].numpy() - g["bf16/rec_logits"][0, 0]).max())
    assert err <= budget, f"{err:.4g} > {budget:.4g}"
    q, k, _, _ = inputs(1, 4, 2, 9, 9, 16, seed=0)
    monkeypatch.setattr(kernels, "compiling_for_cpu", lambda device: True)
    with torch.no_grad():
        assert cpu_prefill.applies(q.bfloat16(), k.bfloat16(), True)
        assert not cpu_prefill.applies(q.bfloat16(), k.bfloat16(), True, flash=False)


def test_a_head_dim_off_the_vector_width_or_bf16_with_amx_tiles_builds_no_kernel(monkeypatch):
    builds = recording_builds(monkeypatch, cpu_prefill)
    monkeypatch.setattr(kernels, "_native_bf16", lambda: True)
    monkeypatch.setattr(cpu_prefill, "_dots", lambda: False)
    cpu_prefill.prepare(2, 24, torch.float32, CPU)  # h = 24: not a multiple of 16
    cpu_prefill.prepare(2, 64, torch.bfloat16, CPU)  # bf16 units with AMX tiles: SDPA's fused bf16 kernel
    assert builds == []
    cpu_prefill.prepare(2, 64, torch.float32, CPU)
    monkeypatch.setattr(cpu_prefill, "_dots", lambda: True)  # bf16 dot products, no tiles
    cpu_prefill.prepare(2, 24, torch.bfloat16, CPU)
    cpu_prefill.prepare(2, 64, torch.bfloat16, CPU)
    monkeypatch.setattr(kernels, "_native_bf16", lambda: False)  # no bf16 units
    monkeypatch.setattr(cpu_prefill, "_dots", lambda: False)
    cpu_prefill.prepare(4, 64, torch.bfloat16, CPU)
    assert builds == [(2, 64, torch.float32), (2, 64, torch.bfloat16), (4, 64, torch.bfloat16)]


def test_a_kernel_that_does_not_build_warns_once_and_keeps_sdpa(monkeypatch):
    without_compiler(monkeypatch, cpu_prefill)
    assert_warns_once(lambda: cpu_prefill.prepare(2, 64, torch.float32, CPU))
    assert cpu_prefill._ready == {cpu_prefill._key(2, 64, torch.float32): False}
