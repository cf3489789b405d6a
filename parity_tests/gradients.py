"""Gradient parity: the same loss in both twins (each family's `runs` defines it), gradients compared per parameter.

Flax gradients come from jax.grad over the param tree, torch gradients from autograd, mapped
to the Flax tree through the family's mapping (convert.mapping); each Flax parameter (scanned
layers stacked) is compared as one tensor. Not per layer: a single layer's scalar gate
gradient is a sum of B*T*D terms that cancel, so its own relative error is ill-conditioned
(Needle v1: 1.6e-5 measured in float32 at the published size while the stacked gate vector
agrees to 1e-6).
"""

from __future__ import annotations

import numpy as np
import torch

from convert.mapping import torch_numpy_to_flax
from convert.trees import flatten_tree
from parity_tests import metrics
from parity_tests.inputs import Batch
from parity_tests.report import GradientResult, ProbeResult
from parity_tests.twins import Twins

TOTAL = "all parameters"  # the whole gradient as one vector


def torch_loss_and_grads(twins: Twins, batch: Batch) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and {Flax path: gradient} from autograd (zeros where a parameter gets none)."""
    model = twins.torch_model
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        loss = twins.adapter.torch_loss(twins, batch)
        loss.backward()
    grads = {name: (torch.zeros_like(p) if p.grad is None else p.grad).detach().float().cpu().numpy()
             for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), flatten_tree(torch_numpy_to_flax(grads, twins.config))


def gradient_parity(twins: Twins, batch: Batch) -> GradientResult:
    """Unjudged per-parameter gradient metrics (torch = test, Flax = reference), in Flax tree order."""
    loss_f, ref = twins.adapter.flax_loss_and_grads(twins, batch)
    loss_t, test = torch_loss_and_grads(twins, batch)
    return GradientResult(loss_f, loss_t, *compare_gradients(test, ref))


def compare_gradients(test: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> tuple[ProbeResult, list]:
    """(the whole gradient as one vector, each tensor), in the reference's order."""
    total, params = metrics.Sums(), []
    for name in ref:
        sums = metrics.Sums().add(test[name], ref[name])
        params.append(ProbeResult(name, list(np.shape(ref[name])), sums.metrics()))
        total.add(test[name], ref[name])
    size = sum(int(np.size(ref[name])) for name in ref)
    return ProbeResult(TOTAL, [size], total.metrics()), params
