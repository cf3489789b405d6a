"""The C++ decode attention (needle_torch/fast/cpu_attention.py) against the twin's own attention, which the Needle 2
goldens pin to upstream's (tests/v2/test_torch_model.py): one query per row over a K/V cache, flash arithmetic."""

from __future__ import annotations

import pytest
import torch

from needle_torch.fast import cpu_attention
from needle_torch.v2.model import FLASH_NEG, dot_product_attention
from tests.kernel_builds import assert_warns_once, recording_builds, without_compiler

# float32: the same products, summed in another order (16-lane partial sums, then across lanes): measured 1.3-5.7e-7.
F32_REL = 1e-6
# bf16: probabilities and outputs are rounded to bf16 as the reference rounds them, from float32 values that differ
# in their last bits (sum order), so an element next to a rounding boundary can land one bf16 ulp away: at most
# one ulp (2^-8 relative to the largest output; measured 1.7e-3), in few elements (measured 0.5 %; 4x that allowed).
BF16_ULP_REL = 2.0 ** -8
BF16_MOVED = 0.02
CPU = torch.device("cpu")

# (dtype, query heads per kv head, head dim, keys): the fixture's heads, the published size's, a bf16 cache, a
# wider group; key counts off the 16-lane width exercise the softmax's tail.
CASES = [(torch.float32, 2, 16, 37), (torch.float32, 2, 64, 320), (torch.bfloat16, 2, 64, 45),
         (torch.float32, 4, 32, 19)]


def inputs(dtype, group, head, keys, rows=11, kv_heads=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, kv_heads * group, 1, head, generator=g).to(dtype)  # (B, H, 1, h)
    k = torch.randn(rows, kv_heads, keys, head, generator=g).to(dtype)  # (B, K, M, h)
    v = torch.randn(rows, kv_heads, keys, head, generator=g).to(dtype)
    keep = torch.rand(rows, keys, generator=g) > 0.3  # holes, as a window with sinks leaves
    keep[0, : keys // 3] = False  # a left-padded row
    keep[1, keys // 2:] = False  # the buffer past the current position
    keep[2] = False  # nothing to attend: upstream's softmax of equal logits, a uniform average
    keep[3] = True
    return q, k, v, keep


def kernel(q, k, v, keep):
    return cpu_attention.attend(q, k, v, keep, FLASH_NEG)  # (B, H, 1, h)


@pytest.mark.parametrize("dtype,group,head,keys", CASES)
def test_the_kernel_is_the_twins_flash_attention(dtype, group, head, keys):
    cpu_attention.prepare(dtype, group, head, CPU, cpu_attention.MIN_UNITS)
    q, k, v, keep = inputs(dtype, group, head, keys)
    assert q.shape[0] * k.shape[1] >= cpu_attention.MIN_UNITS and cpu_attention.applies(q, k, flash=True)
    assert not cpu_attention.applies(q, k, flash=False)  # the non-flash path rounds its logits: the torch form
    out = kernel(q, k, v, keep)
    ref = dot_product_attention(q, k, v, keep[:, None, None, :], flash=True)  # (B, H, 1, h)
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    err = (out.float() - ref.float()).abs()
    scale = ref.float().abs().max()
    if dtype == torch.float32:
        assert err.max() / scale <= F32_REL
    else:
        assert err.max() / scale <= BF16_ULP_REL and (err > 0).float().mean() <= BF16_MOVED
    # the row with no key to attend: the mean of every value row (each kv head's, for its query heads); in bf16
    # p = 1/M and the output are each rounded once (2^-9 relative apiece)
    uniform = v[2].float().mean(dim=1).repeat_interleave(group, dim=0)  # (H, h)
    gap = (out[2, :, 0].float() - uniform).abs().max() / uniform.abs().max()
    assert gap <= (F32_REL if dtype == torch.float32 else BF16_ULP_REL)


def test_masked_keys_are_not_read():
    """A key the mask hides contributes nothing, whatever it holds (NaN included): it is skipped, not weighted 0."""
    cpu_attention.prepare(torch.float32, 2, 16, CPU, cpu_attention.MIN_UNITS)
    q, k, v, keep = inputs(torch.float32, 2, 16, 37)
    keep[2] = True
    out = kernel(q, k, v, keep)
    k2, v2 = k.clone(), v.clone()
    hidden = ~keep[:, None, :, None].expand_as(k)
    k2[hidden], v2[hidden] = float("nan"), float("nan")
    assert torch.equal(kernel(q, k2, v2, keep), out)


def test_a_head_dim_off_the_vector_width_keeps_the_torch_form():
    cpu_attention.prepare(torch.float32, 2, 24, CPU, cpu_attention.MIN_UNITS)
    q = torch.zeros(32, 4, 1, 24)
    k = torch.zeros(32, 2, 8, 24)
    assert not cpu_attention.applies(q, k, flash=True)


def test_a_kernel_that_does_not_build_warns_once_and_keeps_the_torch_form(monkeypatch):
    without_compiler(monkeypatch, cpu_attention)
    assert_warns_once(lambda: cpu_attention.prepare(torch.float32, 2, 16, CPU, cpu_attention.MIN_UNITS))
    q, k = torch.zeros(32, 4, 1, 16), torch.zeros(32, 2, 8, 16)
    assert not cpu_attention.applies(q, k, flash=True)


def test_a_request_too_small_for_the_kernel_builds_none(monkeypatch):
    """new_cache prepares the kernel only for steps that will call it: below MIN_UNITS rows x kv heads, no build."""
    builds = recording_builds(monkeypatch, cpu_attention)
    cpu_attention.prepare(torch.float32, 2, 16, CPU, cpu_attention.MIN_UNITS - 1)
    assert builds == []
    cpu_attention.prepare(torch.float32, 2, 16, CPU, cpu_attention.MIN_UNITS)
    assert builds == [(torch.float32, 2, 16)]
