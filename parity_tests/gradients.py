"""Gradient parity: the same cross-entropy loss in both twins, gradients compared per parameter.

Loss: teacher-forced next-token cross-entropy of the decoder, inputs tgt[:, :-1], labels
tgt[:, 1:], mean over non-pad labels (upstream's training objective for the text path).
Flax gradients come from jax.grad over the param tree, torch gradients from autograd, mapped
to the Flax tree through convert.mapping; each Flax parameter (scanned layers stacked) is
compared as one tensor. Not per layer: a single layer's scalar gate gradient is a sum of
B*T*D terms that cancel, so its own relative error is ill-conditioned (1.6e-5 measured
in float32 at the published size while the stacked gate vector agrees to 1e-6).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from convert.config import TransformerConfig
from convert.mapping import flatten_tree, torch_numpy_to_flax
from parity_tests import metrics
from parity_tests.inputs import Batch
from parity_tests.report import GradientResult, ProbeResult

TOTAL = "all parameters"  # the whole gradient as one vector

if TYPE_CHECKING:
    from parity_tests.engine import Twins


def loss_arrays(batch: Batch, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(decoder inputs (B, T-1), labels (B, T-1), weights (B, T-1) float32: 1 where the label is not padding)."""
    if batch.tgt.shape[1] < 2:
        from convert.errors import NeedleTwinError

        raise NeedleTwinError(f"gradient parity needs --tgt-len >= 2 (inputs and next-token labels), "
                              f"got {batch.tgt.shape[1]}")
    dec_in, labels = batch.tgt[:, :-1], batch.tgt[:, 1:]
    return dec_in, labels, (labels != pad_id).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _flax_value_and_grad(config: TransformerConfig):
    """jit(params, src, dec_in, labels, weights) -> (loss, grads); one per config."""
    import jax
    import jax.numpy as jnp

    from needle_flax import SimpleAttentionNetwork, make_causal_mask, make_padding_mask

    model, pad = SimpleAttentionNetwork(config), config.pad_token_id

    def loss_fn(params, src, dec_in, labels, weights):
        src_mask = make_padding_mask(src, pad)
        tgt_mask = make_causal_mask(dec_in.shape[1]) & make_padding_mask(dec_in, pad)
        logits = model.apply({"params": params}, src, dec_in, src_mask, tgt_mask, src_mask)  # (B, T-1, V) f32
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # (B, T-1)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    return jax.jit(jax.value_and_grad(loss_fn))


def flax_loss_and_grads(twins: Twins, batch: Batch) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and {Flax path: gradient} from jax.grad."""
    import jax

    dec_in, labels, weights = loss_arrays(batch, twins.config.pad_token_id)
    args = [jax.device_put(a, twins.jax_device) for a in (batch.src, dec_in, labels, weights)]
    loss, grads = _flax_value_and_grad(twins.config)(twins.flax_params, *args)
    return float(loss), {k: np.asarray(v) for k, v in flatten_tree(jax.device_get(grads)).items()}


def torch_loss_and_grads(twins: Twins, batch: Batch) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and {Flax path: gradient} from autograd (zeros where a parameter gets none)."""
    import torch
    import torch.nn.functional as F

    from needle_torch import make_causal_mask, make_padding_mask

    model, dev, pad = twins.torch_model, twins.torch_device, twins.config.pad_token_id
    dec_in, labels, weights = (torch.from_numpy(np.ascontiguousarray(a)).to(dev)
                               for a in loss_arrays(batch, pad))
    src = torch.from_numpy(batch.src).long().to(dev)
    dec_in, labels = dec_in.long(), labels.long()
    src_mask = make_padding_mask(src, pad)
    tgt_mask = make_causal_mask(dec_in.shape[1], dev) & make_padding_mask(dec_in, pad)
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = model(src, dec_in, src_mask, tgt_mask, src_mask)  # (B, T-1, V) float32
        nll = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # (B, T-1)
        loss = (nll * weights).sum() / weights.sum().clamp(min=1.0)
        loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = torch.zeros_like(p) if p.grad is None else p.grad
        grads[name] = g.detach().float().cpu().numpy()
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), flatten_tree(torch_numpy_to_flax(grads, twins.config))


def gradient_parity(twins: Twins, batch: Batch) -> GradientResult:
    """Unjudged per-parameter gradient metrics (torch = test, Flax = reference), in Flax tree order."""
    loss_f, ref = flax_loss_and_grads(twins, batch)
    loss_t, test = torch_loss_and_grads(twins, batch)
    params = [ProbeResult(name, list(np.shape(ref[name])), metrics.compare(test[name], ref[name])) for name in ref]
    everything = [np.concatenate([np.ravel(d[name]) for name in ref]) for d in (test, ref)]
    total = ProbeResult(TOTAL, [int(everything[1].size)], metrics.compare(*everything))
    return GradientResult(loss_f, loss_t, total, params)
