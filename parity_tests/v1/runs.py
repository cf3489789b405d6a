"""Needle v1's runs for the parity engine: both twins' probes, the training loss, greedy generation, the CLI's
generate.

Masks as upstream trains: encoder = padding(src); decoder self = causal & padding(tgt);
cross = padding(src).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from convert.errors import NeedleTwinError
from convert.trees import flatten_tree
from convert.v1.config import EOS_ID, TransformerConfig
from needle_flax import layers as flax_layers
from needle_flax.v1 import SimpleAttentionNetwork as FlaxModel
from needle_flax.v1.generate import generate as flax_generate
from needle_flax.v1.generate import generate_recompute as flax_recompute
from needle_torch import layers as torch_layers
from needle_torch.v1 import SimpleAttentionNetwork as TorchModel
from needle_torch.v1.generate import generate as torch_generate
from needle_torch.v1.generate import generate_recompute as torch_recompute
from parity_tests import probes
from parity_tests.generation import generation_config, generation_parity
from parity_tests.inputs import Batch
from parity_tests.twins import Twins
from parity_tests.v1.probes import probe_table


def torch_model(tree: Mapping[str, Any], config: TransformerConfig, dtype: str) -> TorchModel:
    return TorchModel.from_flax(tree, config, dtype)


def table(twins: Twins) -> list[probes.Probe]:
    return probe_table(twins.config)


# ----------------------------------------------------------------------------- probes


@functools.lru_cache(maxsize=8)
def _flax_forward(config: TransformerConfig):
    """jit(params, src, tgt) -> (text-pass intermediates, contrastive-pass intermediates); one per config."""
    model, pad = FlaxModel(config), config.pad_token_id

    def run(params, src, tgt):
        src_mask = flax_layers.make_padding_mask(src, pad)
        tgt_mask = flax_layers.make_attention_mask(tgt, pad)
        _, text = model.apply({"params": params}, src, tgt, src_mask, tgt_mask, src_mask, mutable=[flax_layers.PROBES])
        _, contrastive = model.apply({"params": params}, src, method="encode_contrastive", mutable=[flax_layers.PROBES])
        return text[flax_layers.PROBES], contrastive[flax_layers.PROBES]

    return jax.jit(run)


def flax_probes(twins: Twins, batch: Batch) -> dict[str, np.ndarray]:
    """Every probe of the Flax twin: one jitted text pass plus the contrastive pass."""
    text, contrastive = jax.device_get(_flax_forward(twins.config)(twins.flax_params, twins.to_jax(batch.src),
                                                                   twins.to_jax(batch.tgt)))
    return probes.flax_probes(probe_table(twins.config), {"text": text, "contrastive": contrastive})


def _torch_inputs(twins: Twins, batch: Batch):
    dev, pad = twins.torch_device, twins.config.pad_token_id
    src, tgt = (torch.from_numpy(a).long().to(dev) for a in (batch.src, batch.tgt))
    return src, tgt, torch_layers.make_padding_mask(src, pad), torch_layers.make_attention_mask(tgt, pad)


def torch_probes(twins: Twins, batch: Batch, substitute: Mapping[str, np.ndarray] | None = None
                 ) -> dict[str, np.ndarray]:
    """Every probe of the torch twin; with `substitute`, boundary outputs are replaced by those values."""
    table = probe_table(twins.config)
    subs = None if substitute is None else {p.name: twins.to_torch(substitute[p.name]) for p in table if p.boundary}
    src, tgt, src_mask, tgt_mask = _torch_inputs(twins, batch)
    with torch.inference_mode(), probes.torch_capture(twins.torch_model, table, subs) as captured:
        twins.torch_model(src, tgt, src_mask, tgt_mask, src_mask)
        twins.torch_model.encode_contrastive(src)
    return {name: t.float().cpu().numpy() for name, t in captured.items()}


# ----------------------------------------------------------------------------- loss

# Teacher-forced next-token cross-entropy of the decoder (upstream's training objective for the text path):
# inputs tgt[:, :-1], labels tgt[:, 1:], mean over non-pad labels.


def loss_arrays(batch: Batch, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(decoder inputs (B, T-1), labels (B, T-1), weights (B, T-1) float32: 1 where the label is not padding)."""
    if batch.tgt.shape[1] < 2:
        raise NeedleTwinError(f"gradient parity needs --tgt-len >= 2 (inputs and next-token labels), "
                              f"got {batch.tgt.shape[1]}")
    dec_in, labels = batch.tgt[:, :-1], batch.tgt[:, 1:]
    return dec_in, labels, (labels != pad_id).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _flax_value_and_grad(config: TransformerConfig):
    """jit(params, src, dec_in, labels, weights) -> (loss, grads); one per config."""
    model, pad = FlaxModel(config), config.pad_token_id

    def loss_fn(params, src, dec_in, labels, weights):
        src_mask = flax_layers.make_padding_mask(src, pad)
        tgt_mask = flax_layers.make_attention_mask(dec_in, pad)
        logits = model.apply({"params": params}, src, dec_in, src_mask, tgt_mask, src_mask)  # (B, T-1, V) f32
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # (B, T-1)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    return jax.jit(jax.value_and_grad(loss_fn))


def flax_loss_and_grads(twins: Twins, batch: Batch) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and {Flax path: gradient} from jax.grad."""
    dec_in, labels, weights = loss_arrays(batch, twins.config.pad_token_id)
    args = [twins.to_jax(a) for a in (batch.src, dec_in, labels, weights)]
    loss, grads = _flax_value_and_grad(twins.config)(twins.flax_params, *args)
    return float(loss), {k: np.asarray(v) for k, v in flatten_tree(jax.device_get(grads)).items()}


def torch_loss(twins: Twins, batch: Batch) -> torch.Tensor:
    """The same loss from the torch twin (a scalar with autograd)."""
    pad = twins.config.pad_token_id
    dec_in, labels, weights = (torch.from_numpy(np.ascontiguousarray(a)).to(twins.torch_device)
                               for a in loss_arrays(batch, pad))
    src = torch.from_numpy(batch.src).long().to(twins.torch_device)
    dec_in, labels = dec_in.long(), labels.long()
    src_mask = torch_layers.make_padding_mask(src, pad)
    logits = twins.torch_model(src, dec_in, src_mask, torch_layers.make_attention_mask(dec_in, pad), src_mask)
    nll = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # (B, T-1)
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------- generation


def generation(twins: Twins, batch: Batch, max_new_tokens: int, suppress_tokens: Iterable[int] | None = None
               ) -> dict[str, Any]:
    """Greedy generation parity: both twins decode src with their caches from EOS, and with upstream's loop."""
    src = batch.src.astype(np.int64)
    mask = np.asarray(flax_layers.make_padding_mask(src, twins.config.pad_token_id))
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=EOS_ID, suppress_tokens=suppress_tokens,
              pad_token_id=twins.config.pad_token_id, return_logits=True)

    def run_flax(fn):
        tokens, logits = fn(twins.flax_model, twins.flax_params, jnp.asarray(src, jnp.int32), jnp.asarray(mask), **kw)
        return np.asarray(tokens).astype(np.int64), np.asarray(logits)

    def run_torch(fn):
        dev = twins.torch_device
        tokens, logits = fn(twins.torch_model, torch.from_numpy(src).to(dev), torch.from_numpy(mask).to(dev), **kw)
        return tokens.cpu().numpy().astype(np.int64), logits.cpu().numpy()

    return generation_parity({"flax": run_flax(flax_generate), "torch": run_torch(torch_generate)},
                             {"flax": run_flax(flax_recompute), "torch": run_torch(torch_recompute)},
                             twins.config.pad_token_id, max_new_tokens, suppress_tokens)


def generate_from_checkpoint(checkpoint, src_ids: list[int], *, backend: str = "torch", dtype: str | None = None,
                             max_new_tokens: int = 64, suppress_tokens: Iterable[int] | None = None,
                             streamer=None, compile: bool = False) -> list[int]:
    """Greedy-decode one encoder sequence with a loaded `convert.io.Checkpoint`; ids from the starting EOS on.

    dtype: compute dtype (None = the checkpoint config's; upstream inference uses bfloat16); float32 pins
    full-precision matmuls in both frameworks. streamer: called with each new token id (int) as it is chosen.
    compile: torch backend only, run the decoder step under torch.compile (see needle_torch.v1.generate).
    """
    config = generation_config(checkpoint.config, backend, dtype, compile)
    dtype = config.dtype
    emit = None if streamer is None else (lambda step_tokens: streamer(int(step_tokens[0])))
    args = dict(max_new_tokens=max_new_tokens, eos_token_id=EOS_ID, suppress_tokens=suppress_tokens,
                pad_token_id=config.pad_token_id, streamer=emit)
    if backend == "torch":
        if dtype == "float32":
            torch.set_float32_matmul_precision("highest")
        model = TorchModel.from_flax(checkpoint.params, config, dtype=dtype)
        tokens = model.generate([src_ids], None, **args, compile=compile)  # ids checked before any conversion
    else:
        if dtype == "float32":
            jax.config.update("jax_default_matmul_precision", "highest")
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype), checkpoint.params)  # upstream casts every param
        tokens = flax_generate(FlaxModel(config), params, [src_ids], None, **args)  # checked, then int32
    return [int(t) for t in np.asarray(tokens)[0]]
