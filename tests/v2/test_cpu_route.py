"""The C++ lane routing (needle_torch.fast.cpu_route) against upstream's float32 function, rms_unit(x) φᵀ, computed in
float64 on the same bf16 lanes and weights; and the rule for when a compiled graph calls it. The Needle 2 goldens pin
lanes.route to upstream's (tests/v2/test_torch_model.py), and the compiled bf16 fixture tests run through the kernel
where the CPU has the dot products (tests/v2/test_torch_generate.py, test_cpu_prefill.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from needle_torch.fast import cpu_route, kernels
from needle_torch.v2.lanes import flat_lanes, project, route
from tests.kernel_builds import assert_warns_once, recording_builds, without_compiler

# bf16 lanes and weights: every product exact in float32, float32 sums of n·D of them in another order, the rms factor
# applied after the sums (as lanes.route's compiled float32 form): measured 1.3-2.3e-7 of the largest output against
# the float64 reference, where lanes.project's eager float32 form gives 3.3-4.3e-7 on the same inputs. 1e-6 as the
# other float32 kernels' budget (tests/v2/test_cpu_hadamard.py).
F32_REL = 1e-6
CPU = torch.device("cpu")
LANES, D, OUTS = 4, 64, 24  # 4 lanes of 64: rows of 256, outputs 4 + 4 + 16
needs_dots = pytest.mark.skipif("avx512_bf16" not in kernels.cpu_flags(),
                                reason="the CPU has no AVX512-BF16 dot products (the kernel is built only with them)")


def weights(lanes: int, d_model: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    width = lanes * d_model
    return tuple((0.02 * torch.randn(o, width, generator=g)).bfloat16() for o in (lanes, lanes, lanes * lanes))


def lanes_of(B: int, T: int, lanes: int, d_model: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, T, lanes, d_model, generator=torch.Generator().manual_seed(seed)).bfloat16()


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).abs().max() / ref.abs().max())


@needs_dots
@pytest.mark.parametrize(("lanes", "d_model", "rows"), [(4, 512, 2048), (4, 64, 37), (4, 64, 5)])
def test_the_kernel_is_upstreams_routing_projection(lanes, d_model, rows):
    """A prefill chunk at the published width, and rows off the kernel's blocks of 4."""
    phis = weights(lanes, d_model)
    x = lanes_of(1, rows, lanes, d_model)
    cpu_route.prepare(lanes, d_model, torch.bfloat16, CPU)
    out = cpu_route.lane_route(x.reshape(rows, -1), torch.cat(phis))
    assert out.shape == (rows, 2 * lanes + lanes * lanes) and out.dtype == torch.float32
    ref = flat_lanes(x.double()).double()[0] @ torch.cat(phis).double().t()  # rms_unit in float64
    assert rel(out, ref) <= F32_REL
    eager = torch.cat(project(flat_lanes(x), phis), dim=-1)[0]  # the twin's eager float32 form
    assert rel(eager, ref) <= F32_REL


@needs_dots
def test_compiled_graphs_of_many_bf16_rows_call_the_kernel():
    """Under torch.compile, route over more than REDUCE_MAX_ROWS rows of bf16 lanes calls the op (upstream's values
    within F32_REL); fewer rows, float32 lanes, eager code and a graph that records gradients keep the torch form."""
    phis = weights(LANES, D)
    cpu_route.prepare(LANES, D, torch.bfloat16, CPU)
    key = cpu_route._key(LANES * D, OUTS)
    calls = []
    real = cpu_route._built[key]
    x = lanes_of(2, 5, LANES, D)
    ref = flat_lanes(x.double()).double() @ torch.cat(phis).double().t()  # (2, 5, 24)

    def routed(lanes):
        return torch.cat(route(lanes, phis), dim=-1)

    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        assert rel(routed(x), ref) <= F32_REL and calls == []  # eager: the torch form
        mp.setattr(cpu_route, "_built", {key: lambda *a: (calls.append(a[3]), real(*a))})
        torch._dynamo.reset()
        out = torch.compile(routed, fullgraph=True, dynamic=False)(x)
        assert calls == [10]  # one call over the 2 x 5 rows
        few = torch.compile(routed, fullgraph=True, dynamic=False)(x[:1, :kernels.REDUCE_MAX_ROWS])
        f32 = torch.compile(routed, fullgraph=True, dynamic=False)(x.float())
        assert calls == [10]
    assert rel(out, ref) <= F32_REL
    assert rel(few, ref[:1, :kernels.REDUCE_MAX_ROWS]) <= F32_REL
    assert rel(f32, ref) <= F32_REL
    assert not cpu_route.applies(x, phis)  # not compiling
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "compiling_for_cpu", lambda device: True)
        with torch.no_grad():
            assert cpu_route.applies(x, phis)
            assert not cpu_route.applies(x.float(), phis)
        with torch.enable_grad():
            assert not cpu_route.applies(x, phis)  # the op has no backward


def test_only_bf16_lanes_of_whole_vectors_on_cpus_with_the_dot_products_build_a_kernel(monkeypatch):
    builds = recording_builds(monkeypatch, cpu_route)
    monkeypatch.setattr(cpu_route, "product_path", lambda dtype: 1)
    cpu_route.prepare(LANES, D, torch.float32, CPU)  # float32 lanes: lanes.route's own float32 form
    cpu_route.prepare(LANES, 60, torch.bfloat16, CPU)  # rows of 240: not whole 32-value vectors
    cpu_route.prepare(3, 64, torch.bfloat16, CPU)  # 3 lanes: 15 outputs, not blocks of 4
    monkeypatch.setattr(cpu_route, "product_path", lambda dtype: 0)
    cpu_route.prepare(LANES, D, torch.bfloat16, CPU)  # no bf16 dot products (an AVX2-only CPU)
    assert builds == []
    monkeypatch.setattr(cpu_route, "product_path", lambda dtype: 1)
    cpu_route.prepare(LANES, D, torch.bfloat16, CPU)
    assert builds == [(LANES * D, OUTS)]


def test_a_kernel_that_does_not_build_warns_once_and_keeps_the_torch_form(monkeypatch):
    without_compiler(monkeypatch, cpu_route)
    monkeypatch.setattr(cpu_route, "product_path", lambda dtype: 1)
    assert_warns_once(lambda: cpu_route.prepare(LANES, D, torch.bfloat16, CPU))
    assert cpu_route._ready == {cpu_route._key(LANES * D, OUTS): False}


@pytest.mark.parametrize("header, sources", [
    ("bf16_dots.h", ("lane_route.cpp", "decode_step.cpp")),
    ("bf16_lanes.h", ("decode_step.cpp", "decode_attention.cpp", "hadamard_mlp.cpp", "prefill_attention.cpp")),
    ("walsh.h", ("decode_step.cpp", "hadamard_mlp.cpp")),
])
def test_the_kernels_sources_inline_their_shared_headers(header, sources):
    """The build compiles a string: kernels.cpp_source puts each shared header's text where a kernel's source includes
    it, once each, and leaves no local include behind (the toolchain would not find the file)."""
    csrc = Path(cpu_route.__file__).with_name("csrc")
    text_of_header = (csrc / header).read_text()
    for name in sources:
        text = kernels.cpp_source(csrc / name)
        assert text.count(text_of_header) == 1, name
        assert not any(line.startswith('#include "') for line in text.splitlines()), name
