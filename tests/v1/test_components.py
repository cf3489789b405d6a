"""Each piece of the shared vocabulary, in both twins, against an independent numpy formulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import needle_flax as nf
import needle_torch as nt
from convert.v1.config import TransformerConfig
from needle_torch.fast import kernels
from needle_torch.fast import v1 as fast_v1
from needle_torch.fast.kernels import REDUCE_MAX_ROWS, as_reduction

F32 = dict(rtol=1e-6, atol=1e-6)  # single float32 ops: a few ulps of roundoff


def test_zc_rmsnorm_is_one_plus_gamma_times_x_over_rms():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 8)).astype(np.float32)
    gamma = rng.standard_normal(8).astype(np.float32)
    expected = (1 + gamma) * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6)

    norm = nt.ZCRMSNorm(8)
    with torch.no_grad():
        norm.scale.copy_(torch.from_numpy(gamma))
        np.testing.assert_allclose(norm(torch.from_numpy(x)).numpy(), expected, **F32)
    got = nf.ZCRMSNorm(dtype=jnp.float32).apply({"params": {"scale": gamma}}, x)
    np.testing.assert_allclose(np.asarray(got), expected, **F32)


def test_zc_rmsnorm_starts_as_plain_rmsnorm_and_keeps_stats_in_float32():
    x = torch.full((1, 4), 300.0, dtype=torch.bfloat16)  # x**2 = 9e4 would lose bits in bf16 statistics
    out = nt.ZCRMSNorm(4)(x)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, torch.ones_like(out))


def _rotate_half_rope(x: np.ndarray, theta: float = 10000.0) -> np.ndarray:
    """Gemma/LLaMA-HF style: x * cos + rotate_half(x) * sin with duplicated tables."""
    h, T = x.shape[-1], x.shape[-2]
    inv = 1.0 / theta ** (np.arange(0, h, 2) / h)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rotated = np.concatenate([-x[..., h // 2:], x[..., : h // 2]], -1)
    return x * cos + rotated * sin


@pytest.mark.parametrize("h,theta", [(8, 10000.0), (16, 500.0)])
def test_half_split_rope_equals_rotate_half(h, theta):
    x = np.random.default_rng(1).standard_normal((2, 3, 11, h)).astype(np.float32)
    expected = _rotate_half_rope(x.astype(np.float64), theta)
    cos, sin = nt.precompute_rope_freqs(h, 11, theta)
    np.testing.assert_allclose(nt.apply_rope(torch.from_numpy(x), cos, sin).numpy(), expected, rtol=1e-5, atol=1e-5)
    cos, sin = nf.precompute_rope_freqs(h, 11, theta)
    np.testing.assert_allclose(np.asarray(nf.apply_rope(jnp.asarray(x), cos, sin)), expected, rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    rng = np.random.default_rng(2)
    q, k = (torch.from_numpy(rng.standard_normal((1, 1, 1, 8)).astype(np.float32)) for _ in range(2))
    cos, sin = nt.precompute_rope_freqs(8, 20)
    def score(m, n):  # q at position m, k at position n
        return float((nt.apply_rope(q, cos[m:], sin[m:]) * nt.apply_rope(k, cos[n:], sin[n:])).sum())
    assert score(7, 3) == pytest.approx(score(14, 10), abs=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), abs=1e-3)


def test_rope_promotes_reduced_precision_to_float32_like_upstream():
    cos, sin = nt.precompute_rope_freqs(4, 3)
    assert nt.apply_rope(torch.ones(1, 1, 3, 4, dtype=torch.bfloat16), cos, sin).dtype == torch.float32
    cos, sin = nf.precompute_rope_freqs(4, 3)
    assert nf.apply_rope(jnp.ones((1, 1, 3, 4), jnp.bfloat16), cos, sin).dtype == jnp.float32


def test_gqa_repeats_each_kv_head_consecutively():
    x = np.arange(2 * 3 * 2 * 1, dtype=np.float32).reshape(2, 3, 2, 1)  # (B, K=3, T, h)
    order = [0, 0, 1, 1, 2, 2]  # head j reads kv head j // repeats, not j % K
    np.testing.assert_array_equal(nt.repeat_kv(torch.from_numpy(x), 2).numpy(), x[:, order])
    np.testing.assert_array_equal(np.asarray(nf.repeat_kv(jnp.asarray(x), 2)), x[:, order])


def _reference_attention(q, k, v, mask):
    """float64 softmax(q k^T / sqrt(h)) v with explicit consecutive KV repetition."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(mask, s, np.finfo(np.float32).min)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


@pytest.mark.parametrize("heads,kv", [(4, 1), (4, 2), (6, 3), (2, 2)])
def test_attention_paths_match_reference(heads, kv):
    """SDPA path (float32 q/k) and grouped eager path (other dtypes) both equal the reference."""
    rng = np.random.default_rng(heads * 10 + kv)
    q = rng.standard_normal((2, heads, 5, 8))
    k, v = rng.standard_normal((2, kv, 7, 8)), rng.standard_normal((2, kv, 7, 8))
    mask = np.ones((2, 1, 5, 7), bool)
    mask[0, :, :, 4:] = False  # padding
    mask[1, :, 2] = False  # one fully masked query row
    expected = _reference_attention(q, k, v, mask)
    as_t = lambda a, dt: torch.from_numpy(a).to(dt)  # noqa: E731
    sdpa = nt.dot_product_attention(as_t(q, torch.float32), as_t(k, torch.float32), as_t(v, torch.float32),
                                    torch.from_numpy(mask))
    np.testing.assert_allclose(sdpa.numpy(), expected, rtol=1e-5, atol=1e-5)
    eager = nt.dot_product_attention(as_t(q, torch.float64), as_t(k, torch.float64), as_t(v, torch.float64),
                                     torch.from_numpy(mask))  # float64 q/k take the grouped eager path
    np.testing.assert_allclose(eager.numpy(), expected, rtol=1e-5, atol=1e-5)
    # The fully masked row is the uniform average of v, not NaN.
    np.testing.assert_allclose(sdpa[1, :, 2].numpy(), np.repeat(v[1], heads // kv, 0).mean(1), rtol=1e-5, atol=1e-5)


def test_masks_agree_between_twins():
    rng = np.random.default_rng(3)
    tokens = np.array([[5, 6, 0, 0], [7, 0, 0, 0]], np.int32)
    seg = rng.integers(0, 3, (2, 6)).astype(np.int32)
    dec_seg = rng.integers(0, 3, (2, 4)).astype(np.int32)
    pairs = [
        (nt.make_padding_mask(torch.from_numpy(tokens)), nf.make_padding_mask(jnp.asarray(tokens))),
        (nt.make_causal_mask(5), nf.make_causal_mask(5)),
        (nt.make_packing_mask(torch.from_numpy(seg)), nf.make_packing_mask(jnp.asarray(seg))),
        (nt.make_causal_packing_mask(torch.from_numpy(seg)), nf.make_causal_packing_mask(jnp.asarray(seg))),
        (nt.make_cross_packing_mask(torch.from_numpy(seg), torch.from_numpy(dec_seg)),
         nf.make_cross_packing_mask(jnp.asarray(seg), jnp.asarray(dec_seg))),
    ]
    for t, f in pairs:
        assert t.dtype == torch.bool and t.ndim == 4
        np.testing.assert_array_equal(t.numpy(), np.asarray(f))
    np.testing.assert_array_equal(pairs[0][0].numpy()[:, 0, 0], tokens != 0)
    assert not pairs[2][0].numpy()[:, 0][seg == 0].any()  # a padding query attends to nothing


CFG = TransformerConfig(vocab_size=40, d_model=16, num_heads=4, num_kv_heads=2, max_seq_len=16)


def test_torch_cached_self_attention_equals_uncached():
    torch.manual_seed(0)
    attn = nt.MultiHeadAttention(CFG).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.3)
        x = torch.randn(2, 6, 16)
        rope = nt.precompute_rope_freqs(4, 6)
        full = attn(x, x, nt.make_causal_mask(6), rope)
        cache = nt.LayerCache(torch.zeros(2, 2, 6, 4), torch.zeros(2, 2, 6, 4))
        prefix = attn(x[:, :3], x[:, :3], nt.make_causal_mask(3), (rope[0][:3], rope[1][:3]), cache=cache)
        steps = [attn(x[:, t:t + 1], x[:, t:t + 1], None, (rope[0][t:], rope[1][t:]), cache=cache, cache_pos=t)
                 for t in range(3, 6)]
    np.testing.assert_allclose(torch.cat([prefix, *steps], 1).numpy(), full.numpy(), rtol=1e-5, atol=1e-6)


def test_flax_cached_self_attention_equals_uncached():
    attn = nf.MultiHeadAttention(4, 2, 16, 4, jnp.float32)
    attn_dec = nf.MultiHeadAttention(4, 2, 16, 4, jnp.float32, decode=True, cache_len=6)
    x = jax.random.normal(jax.random.PRNGKey(1), (2, 6, 16))
    rope = nf.precompute_rope_freqs(4, 6)
    params = attn.init(jax.random.PRNGKey(2), x, x, rope=rope)["params"]
    params = jax.tree_util.tree_map(lambda p: p + 0.3 * jax.random.normal(jax.random.PRNGKey(3), p.shape), params)
    full = attn.apply({"params": params}, x, x, mask=nf.make_causal_mask(6), rope=rope)
    cache = attn_dec.init(jax.random.PRNGKey(0), x[:, :1], x[:, :1], rope=rope, cache_pos=0)["cache"]
    outs = []
    for t in range(6):
        mask = (jnp.arange(6) <= t)[None, None, None, :]
        out, state = attn_dec.apply({"params": params, "cache": cache}, x[:, t:t + 1], x[:, t:t + 1], mask=mask,
                                    rope=(rope[0][t:], rope[1][t:]), cache_pos=t, mutable=["cache"])
        cache = state["cache"]
        outs.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outs, 1)), np.asarray(full), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- few-row products under compile


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_products_as_reductions_equal_matmul(dtype):
    """matmul_nt's multiply-and-sum form (compiled decode steps) computes what the matmul computes."""
    from needle_torch.fast.kernels import matmul_nt

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, 4, 64, generator=gen).to(dtype)  # (..., M, I)
    b = torch.randn(2, 3, 9, 64, generator=gen).to(dtype)  # (..., N, I)
    by_matmul, by_sum = matmul_nt(a, b, dtype), matmul_nt(a, b, dtype, reduce=True)
    assert by_sum.dtype == by_matmul.dtype == dtype and by_sum.shape == (2, 3, 4, 9)
    exact = (a.double() @ b.double().transpose(-1, -2))
    # Both accumulate exact products in float32 and round once to dtype; only the order of the float32 sum
    # differs, so each is within one rounding of dtype (2^-8 bf16, 2^-11 f16, 2^-24 f32 relative) of the exact
    # product, plus float32's summation error over 64 terms (~64 * 2^-24) relative to max |exact|.
    ulp = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[dtype]
    bound = (ulp + 64 * 2.0**-24) * float(exact.abs().max())
    for got in (by_matmul, by_sum):
        assert float((got.double() - exact).abs().max()) <= bound


def test_reduction_form_only_under_compile_and_for_few_rows():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert not as_reduction(1, cpu)  # eager keeps BLAS / oneDNN

    def probe(x):
        return (x + (1 if as_reduction(REDUCE_MAX_ROWS, cpu) else 0) + (10 if as_reduction(REDUCE_MAX_ROWS + 1, cpu)
                else 0) + (100 if as_reduction(1, cuda) else 0))

    out = torch.compile(probe, backend="eager", fullgraph=True)(torch.zeros(()))
    assert float(out) == 1.0  # only the few-row CPU product


def test_a_stored_input_is_eagers_rounded_value_in_a_compiled_product():
    """kernels.stored: the tensor itself in eager code; in a compiled CPU graph where few-row products read it, a
    buffer holding what eager computes, rounded to its dtype. Inlined into the product instead, inductor keeps the
    bf16 op's float32 value and the sums move by ~2^-9 of their size; stored, only their float32 order differs."""
    torch.manual_seed(0)
    x, w = torch.randn(1, 1, 64), torch.randn(48, 64).bfloat16()

    def product(x):
        y = kernels.stored((x * 1.37).to(torch.bfloat16))  # rounded to bf16 in eager
        return kernels.matmul_nt(y, w, torch.float32, reduce=kernels.as_reduction(1, x.device))

    y = (x * 1.37).to(torch.bfloat16)
    assert kernels.stored(y) is y
    with torch.inference_mode():
        eager = product(x)
        torch._dynamo.reset()
        compiled = torch.compile(product, fullgraph=True)(x)
    assert float((compiled - eager).abs().max()) <= 1e-6 * float(eager.abs().max())  # float32 sum order only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_few_row_projections_attention_and_logits_equal_eager(dtype):
    """The fast reduction forms a compiled decode step uses equal the plain eager modules (aot_eager runs the traced
    graph)."""
    cfg = TransformerConfig(vocab_size=50, d_model=32, num_heads=4, num_kv_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    model = nt.SimpleAttentionNetwork(cfg).to(dtype).eval()
    proj = kernels.Linear(32, 8).to(dtype)
    torch.nn.init.normal_(proj.bias)
    x = torch.randn(1, 2, 32).to(dtype)  # 2 rows: the reduction form
    q = torch.randn(1, 4, 1, 8)  # float32 q/k (self-attention after RoPE) ...
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    mask = torch.tensor([True] * 4 + [False] * 2)[None, None, None]
    qb, kb = q.to(dtype), k.to(dtype)  # ... and compute-dtype q/k (cross-attention)

    def plain(x, q, k, v, qb, kb):
        return (torch.nn.functional.linear(x, proj.weight, proj.bias), nt.dot_product_attention(q, k, v, mask),
                nt.dot_product_attention(qb, kb, v, mask), model._logits(x))

    def pieces(x, q, k, v, qb, kb):
        return (proj(x), fast_v1.dot_product_attention(q, k, v, mask), fast_v1.dot_product_attention(qb, kb, v, mask),
                fast_v1.logits(model, x))

    with torch.inference_mode():
        eager = plain(x, q, k, v, qb, kb)
        compiled = torch.compile(pieces, backend="aot_eager", fullgraph=True)(x, q, k, v, qb, kb)
    # Same roundings in both forms; the float32 sums differ in order only: ~1e-6 relative in float32, and at
    # most one rounding step (2^-8 relative) where a bfloat16 result is rounded.
    tol = 1e-6 if dtype == torch.float32 else 2.0**-8
    names = ["linear", "attention f32 q/k", "attention dtype q/k", "logits"]
    for name, e, c in zip(names, eager, compiled, strict=True):
        assert c.dtype == e.dtype and c.shape == e.shape, name
        assert float((c.double() - e.double()).abs().max()) <= tol * float(e.double().abs().max()), name


def test_torch_dtype_names_are_the_config_dtypes_and_unknown_names_fail_in_one_line():
    from convert.errors import ConfigError
    from convert.fields import DTYPES
    from convert.mapping import random_flax_params
    from convert.v1.config import TransformerConfig
    from needle_torch.layers import TORCH_DTYPES

    assert tuple(TORCH_DTYPES) == DTYPES
    cfg = TransformerConfig(vocab_size=40, d_model=16, num_heads=4, num_kv_heads=2, max_seq_len=16)
    params = random_flax_params(cfg, seed=0)
    for name in DTYPES:
        model = nt.SimpleAttentionNetwork.from_flax(params, cfg, dtype=name)
        assert model.dtype == TORCH_DTYPES[name] == getattr(torch, name)
    with pytest.raises(ConfigError, match=r"^dtype 'fp16' is unknown; use one of float32, bfloat16, float16"):
        nt.SimpleAttentionNetwork.from_flax(params, cfg, dtype="fp16")
