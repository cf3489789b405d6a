"""The C++ Sinkhorn (needle_torch.fast.cpu_sinkhorn) against the twin's own lanes.sinkhorn, which the Needle 2 goldens
pin to upstream's (tests/v2/test_torch_model.py): float32 (n, n) routing logits, 20 steps, then exp."""

from __future__ import annotations

import pytest
import torch

from needle_torch.fast import cpu_sinkhorn, kernels
from needle_torch.fast import v2 as fast_v2
from needle_torch.v2.lanes import SINKHORN_ITERS, sinkhorn
from tests.kernel_builds import assert_warns_once, without_compiler

# The same steps in the same order; the vector exp and log may differ from the library's in their last bit, and the
# outputs are weights in [0, 1]: measured 1.2-2.4e-7 from eager.
F32_ABS = 1e-6
CPU = torch.device("cpu")


@pytest.mark.parametrize("lanes,rows", [(4, 37), (4, 2048), (3, 21), (2, 5), (1, 17)])
def test_the_kernel_is_the_twins_sinkhorn(lanes, rows):
    """Lane counts of the published model and the test models; row counts off the 16-row blocks (the tail)."""
    cpu_sinkhorn.prepare(lanes, CPU)
    z = torch.randn(rows, lanes, lanes, generator=torch.Generator().manual_seed(lanes)) * 4 + 4 * torch.eye(lanes)
    out = cpu_sinkhorn.sinkhorn_op(z, SINKHORN_ITERS)
    ref = sinkhorn(z)
    assert out.shape == ref.shape and (out - ref).abs().max() <= F32_ABS
    assert (out.sum(-2) - 1).abs().max() <= 1e-5  # the last step normalised every column (n float32 terms)


def test_compiled_graphs_of_many_rows_call_the_kernel():
    """Under torch.compile the fast Sinkhorn of more than REDUCE_MAX_ROWS rows of float32 logits goes through the op
    (eager's values);
    fewer, eager code and a graph that records gradients keep the torch form."""
    cpu_sinkhorn.prepare(4, CPU)
    calls = []
    real = cpu_sinkhorn._built[4]
    z = torch.randn(2, 5, 4, 4, generator=torch.Generator().manual_seed(3)) * 4
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_sinkhorn, "_built", {4: lambda *a: (calls.append(a[2]), real(*a))})
        ref = fast_v2.sinkhorn(z)
        assert calls == []  # eager: the torch form
        torch._dynamo.reset()
        out = torch.compile(fast_v2.sinkhorn, fullgraph=True, dynamic=False)(z)
        assert calls == [10]  # one call over the 2 x 5 rows
        few = torch.compile(fast_v2.sinkhorn, fullgraph=True, dynamic=False)(z[:1, :kernels.REDUCE_MAX_ROWS])
        assert calls == [10]
        mp.setattr(kernels, "compiling_for_cpu", lambda device: True)
        assert cpu_sinkhorn.applies(z) and not cpu_sinkhorn.applies(z.double())
        with torch.enable_grad():
            assert not cpu_sinkhorn.applies(z)  # the op has no backward
    assert (out - ref).abs().max() <= F32_ABS
    assert (few - ref[:1, :kernels.REDUCE_MAX_ROWS]).abs().max() <= F32_ABS


def test_a_kernel_that_does_not_build_warns_once_and_keeps_the_torch_form(monkeypatch):
    without_compiler(monkeypatch, cpu_sinkhorn)
    assert_warns_once(lambda: cpu_sinkhorn.prepare(4, CPU))
    assert cpu_sinkhorn._ready == {4: False}
