"""The C++ Hadamard MLP (needle_torch.fast.cpu_hadamard) against the twin's own HadamardMLP, which the Needle 2 goldens
pin to upstream's (tests/v2/test_torch_model.py): float32 and bf16 rows, the Walsh products as butterflies."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from convert.v2.config import NEEDLE_V2_PUBLISHED
from needle_torch.fast import cpu_hadamard, kernels
from needle_torch.fast import v2 as fast_v2
from needle_torch.v2.model import HadamardMLP
from tests.kernel_builds import assert_warns_once, recording_builds, without_compiler

# float32: the same terms of each Walsh product summed in another order (butterflies against a dense product, one
# multiply by H_P's entry at the end): measured 3.0-4.7e-7 of the largest output.
F32_REL = 1e-6
# bf16: every op rounded where eager's bf16 tensors round, so outputs are eager's bit for bit except where a Walsh
# sum's other order lands on the other side of a bf16 rounding: that element moves by one bf16 ulp (<= 2^-7 of its
# magnitude) and the second product carries it into the row's outputs. Measured: 0 elements off at 37 rows, 0.07 %
# (1.9e-3 of the largest output) at 2048 rows of the published width. tests/v2/test_cpu_decode.py's bf16 budget:
# twice the ulp bound, and a share of 2 % of the elements.
BF16_REL = 2.0 ** -6
BF16_SHARE = 0.02
CPU = torch.device("cpu")


def mlp(d_model: int, seed: int = 0) -> HadamardMLP:
    m = HadamardMLP(dataclasses.replace(NEEDLE_V2_PUBLISHED, d_model=d_model, num_heads=1, num_kv_heads=1))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return m


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("d_model", [512, 48])  # the published width (P = D), and P = 64 > D = 48 (padded)
@pytest.mark.parametrize("rows", [37, 2048])  # rows off the thread split; a prefill chunk's
def test_the_kernel_is_the_twins_hadamard_mlp(d_model, dtype, rows):
    m = mlp(d_model).to(dtype)
    P = m.d1.shape[0]
    cpu_hadamard.prepare(d_model, P, dtype, CPU)
    x = torch.randn(rows, d_model, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        ref = m(x)  # eager: the dense Walsh product, every op rounded to dtype
        out = cpu_hadamard.hadamard_mlp(x, m.d1, m.d2, m.d3)
    assert out.shape == ref.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        assert rel(out, ref) <= F32_REL
    else:
        assert rel(out, ref) <= BF16_REL
        assert (out != ref).double().mean().item() <= BF16_SHARE


def test_compiled_graphs_of_many_float32_rows_call_the_kernel():
    """Under torch.compile, the fast HadamardMLP of more than REDUCE_MAX_ROWS float32 rows calls the op (eager's
    values); fewer rows, eager code and a graph that records gradients keep the torch form; bf16 rows call their own
    build, and rows whose dtype is not the weights' keep the torch form."""
    m = mlp(48)
    cpu_hadamard.prepare(48, 64, torch.float32, CPU)
    calls = []
    real = cpu_hadamard._built[cpu_hadamard._key(48, 64)]
    kernels_ = {cpu_hadamard._key(48, 64): lambda *a: (calls.append(a[5]), real(*a))}
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(x)
        assert calls == []  # eager: the torch form
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu_hadamard, "_built", kernels_)
            torch._dynamo.reset()
            out = torch.compile(lambda x: fast_v2.hadamard_mlp(m, x), fullgraph=True, dynamic=False)(x)
            assert calls == [10]  # one call over the 2 x 5 rows
            few = torch.compile(lambda x: fast_v2.hadamard_mlp(m, x), fullgraph=True,
                                dynamic=False)(x[:1, :kernels.REDUCE_MAX_ROWS])
            assert calls == [10]
    assert (out - ref).abs().max() / ref.abs().max() <= F32_REL
    assert (few - ref[:1, :kernels.REDUCE_MAX_ROWS]).abs().max() / ref.abs().max() <= F32_REL
    assert not cpu_hadamard.applies(x, m.d1)  # not compiling
    xb, d1b = x.to(torch.bfloat16), m.d1.to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "compiling_for_cpu", lambda device: True)
        mp.setattr(cpu_hadamard, "_ready", {cpu_hadamard._key(48, 64, torch.float32): True})  # the float32 build only
        with torch.no_grad():
            assert cpu_hadamard.applies(x, m.d1)
            assert not cpu_hadamard.applies(x[:1, :kernels.REDUCE_MAX_ROWS], m.d1)
            assert not cpu_hadamard.applies(xb, d1b)  # no bf16 build
            cpu_hadamard._ready[cpu_hadamard._key(48, 64, torch.bfloat16)] = True
            assert cpu_hadamard.applies(xb, d1b)
            assert not cpu_hadamard.applies(xb, m.d1)  # rows and weights in two dtypes
        with torch.enable_grad():
            assert not cpu_hadamard.applies(x, m.d1)  # the op has no backward


def test_compiled_graphs_of_many_bf16_rows_call_the_bf16_build():
    m = mlp(48).to(torch.bfloat16)
    cpu_hadamard.prepare(48, 64, torch.bfloat16, CPU)
    key = cpu_hadamard._key(48, 64, torch.bfloat16)
    calls = []
    real = cpu_hadamard._built[key]
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        ref = m(x)
        mp.setattr(cpu_hadamard, "_built", {key: lambda *a: (calls.append(a[5]), real(*a))})
        torch._dynamo.reset()
        out = torch.compile(lambda x: fast_v2.hadamard_mlp(m, x), fullgraph=True, dynamic=False)(x)
    assert calls == [10] and out.dtype == torch.bfloat16
    assert rel(out, ref) <= BF16_REL and (out != ref).double().mean().item() <= BF16_SHARE


def test_a_width_off_the_vector_width_builds_no_kernel(monkeypatch):
    builds = recording_builds(monkeypatch, cpu_hadamard)
    cpu_hadamard.prepare(40, 64, torch.float32, CPU)  # D = 40: not a multiple of 16
    cpu_hadamard.prepare(40, 64, torch.bfloat16, CPU)
    cpu_hadamard.prepare(48, 64, torch.float16, CPU)  # float32 and bf16 only
    assert builds == []
    cpu_hadamard.prepare(48, 64, torch.float32, CPU)
    cpu_hadamard.prepare(48, 64, torch.bfloat16, CPU)
    assert builds == [(48, 64, torch.float32), (48, 64, torch.bfloat16)]


def test_a_kernel_that_does_not_build_warns_once_and_keeps_the_torch_form(monkeypatch):
    without_compiler(monkeypatch, cpu_hadamard)
    assert_warns_once(lambda: cpu_hadamard.prepare(48, 64, torch.float32, CPU))
    assert cpu_hadamard._ready == {cpu_hadamard._key(48, 64): False}
