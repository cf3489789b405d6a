"""Needle 3's runs for the parity engine: both twins' probes pass by pass (depth rungs included) and the training
loss.

Every pass uses the mask of a right-padded batch, causal ∧ padding (what hidden_cells and the heads build
themselves), so pads never reach a real position. Only the "forward" pass collects sown values: its layers run
outside `nn.cond`, while a rung's sub-stream runs inside one, whose branches could not sow alike.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from convert.errors import NeedleTwinError
from convert.mapping import torch_to_flax
from convert.rules import TORCH
from convert.trees import flatten_tree
from convert.v3.config import TransformerConfig
from convert.v3.family import FAMILY
from convert.v3.ladder import ladder_config, ladder_slice
from needle_flax import layers as flax_layers
from needle_flax.v3 import SimpleAttentionNetwork as FlaxModel
from needle_torch import layers as torch_layers
from needle_torch.v3 import SimpleAttentionNetwork as TorchModel
from parity_tests import flips, probes
from parity_tests.inputs import Batch
from parity_tests.twins import Twins
from parity_tests.v3.probes import DEFAULT_PASSES, HEADS, probe_table


def torch_model(tree: Mapping[str, Any], config: TransformerConfig, dtype: str) -> TorchModel:
    return TorchModel.from_flax(tree, config, dtype)


def sliced_model(twins: Twins, depth: int) -> TorchModel:
    """The torch twin's rung `depth` as a model of its own: its own weights (a --torch file's, when given) sliced as
    `needle build --layers` slices a checkpoint."""
    config = twins.config
    tree = torch_to_flax(twins.torch_model.state_dict(), config)
    return torch_model(ladder_slice(tree, config, depth), ladder_config(config, depth), config.dtype
                       ).to(twins.torch_device).eval()


def parse_depth(config: TransformerConfig, depth: str | None) -> tuple[int, ...]:
    """`--depth d|all` -> the rungs to compare: d (2 <= d <= L), or every rung 2..L."""
    if depth is None:
        return ()
    L = config.num_layers
    if depth == "all":
        return tuple(range(2, L + 1))
    try:
        d = int(depth)
    except ValueError:
        raise NeedleTwinError(f"--depth {depth!r} is not a rung: give d with 2 <= d <= {L}, or all") from None
    if not 2 <= d <= L:
        raise NeedleTwinError(f"--depth {d} is outside this model's ladder: rungs run 2..{L} (num_layers), or all")
    return (d,)


def groups(twins: Twins) -> tuple[str, ...]:
    """The optional groups both twins hold (the torch twin was built from the tree, so it has exactly those)."""
    return FAMILY.groups_in(twins.torch_model.state_dict(), TORCH, twins.config)


def table(twins: Twins, passes=DEFAULT_PASSES) -> list[probes.Probe]:
    if twins.config.dtype != "float32":  # the flip margins are float32 noise; a half-precision run has no quant pass
        passes = tuple(p for p in passes if p != "quant")
    return probe_table(twins.config, groups(twins), passes, getattr(twins, "depths", ()))


def _passes(probe_list: list[probes.Probe]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.pass_ for p in probe_list))


# ----------------------------------------------------------------------------- probes


@functools.lru_cache(maxsize=16)
def _flax_passes(config: TransformerConfig, passes: tuple[str, ...]):
    """jit(params, tokens) -> {pass: intermediates}; return values are added under their probe names. One function
    for all passes: XLA compiles it in less time than the passes compiled one by one."""
    model, pad = FlaxModel(config), config.pad_token_id
    mutable = [flax_layers.PROBES]

    def run(params, tokens):
        mask = flax_layers.make_attention_mask(tokens, pad)
        out = {}
        for name in passes:
            if name == "quant":  # run apart, traced (_flax_quant)
                continue
            if name == "forward":
                logits, col = model.apply({"params": params}, tokens, mask, mutable=mutable)
                out[name] = {**col[flax_layers.PROBES], "logits": (logits,)}
            elif name == "cells":
                out[name] = {"hidden_cells": (model.apply({"params": params}, tokens, method="hidden_cells"),)}
            elif name in HEADS:
                value, col = model.apply({"params": params}, tokens, method=f"forward_{name}", mutable=mutable)
                out[name] = {**col[flax_layers.PROBES], name: (value,)}
            else:  # depth{d}
                d = int(name.removeprefix("depth"))
                _, exit_logits = model.apply({"params": params}, tokens, mask, exit_depth=d)
                sub = model.apply({"params": params}, tokens, mask, exit_depth=d, subnetwork_only=True)
                out[name] = {f"{name}.exit_logits": (exit_logits,), f"{name}.sub_logits": (sub,)}
                if d < config.num_layers:  # the rung as a model of its own
                    rung = FlaxModel(ladder_config(config, d))
                    sliced = rung.apply({"params": ladder_slice(params, config, d)}, tokens, mask)
                    out[name][f"{name}.sliced_logits"] = (sliced,)
        return out

    return jax.jit(run)


def flax_probes(twins: Twins, batch: Batch, passes=DEFAULT_PASSES) -> dict[str, np.ndarray]:
    """Every probe of the Flax twin, one jitted function over the passes."""
    probe_list = table(twins, passes)
    run = _flax_passes(twins.config, tuple(p for p in _passes(probe_list) if p != "quant"))
    tokens = twins.to_jax(batch.tokens)
    collections = jax.device_get(run(twins.flax_params, tokens))
    out = probes.flax_probes([p for p in probe_list if p.pass_ != "quant"], collections)
    if "quant" in _passes(probe_list):
        out["quant_logits"] = _flax_quant(twins, tokens)
    return out


def _flax_quant(twins: Twins, tokens) -> np.ndarray:
    """quant=True logits, the quantiser calls recorded in twins.quant_calls["flax"]. A fresh jit inside the trace
    (a cached one has no callbacks), outside the passes' jit (their sown collections would carry it)."""
    model, pad = FlaxModel(twins.config), twins.config.pad_token_id

    def run(params, tokens):
        return model.apply({"params": params}, tokens, flax_layers.make_attention_mask(tokens, pad), quant=True)

    with flips.trace_flax("v3") as calls:
        logits = jax.device_get(jax.jit(run)(twins.flax_params, tokens))
    flips.record(twins, "flax", calls)
    return np.asarray(logits, np.float32)


def torch_probes(twins: Twins, batch: Batch, substitute: Mapping[str, np.ndarray] | None = None,
                 passes=DEFAULT_PASSES) -> dict[str, np.ndarray]:
    """Every probe of the torch twin, pass by pass; with `substitute`, boundary outputs take those values."""
    model, probe_list = twins.torch_model, table(twins, passes)
    tokens = torch.from_numpy(batch.tokens).long().to(twins.torch_device)
    mask = torch_layers.make_attention_mask(tokens, twins.config.pad_token_id)

    def call(name: str) -> dict[str, torch.Tensor]:
        if name == "forward":
            return {"logits": model(tokens, mask)}
        if name == "quant":
            with flips.trace_torch(model, align=flips.reference_calls(twins)) as calls:
                logits = model(tokens, mask, quant=True)
            flips.record(twins, "torch", calls)
            return {"quant_logits": logits}
        if name == "cells":
            return {"hidden_cells": model.hidden_cells(tokens)}
        if name in HEADS:
            return {name: getattr(model, f"forward_{name}")(tokens)}
        d = int(name.removeprefix("depth"))
        out = {f"{name}.exit_logits": model(tokens, mask, exit_depth=d)[1],
               f"{name}.sub_logits": model(tokens, mask, exit_depth=d, subnetwork_only=True)}
        if d < twins.config.num_layers:
            out[f"{name}.sliced_logits"] = sliced_model(twins, d)(tokens, mask)
        return out

    out: dict[str, np.ndarray] = {}
    with torch.no_grad():  # not inference_mode: the Monarch MLP caches its permutations for later autograd runs
        for name in _passes(probe_list):
            hooked = [p for p in probe_list if p.pass_ == name and p.torch]
            subs = None if substitute is None else {p.name: twins.to_torch(substitute[p.name])
                                                    for p in hooked if p.boundary}
            with probes.torch_capture(model, hooked, subs) as captured:
                returned = call(name)
            out.update({k: t.float().cpu().numpy() for k, t in {**captured, **returned}.items()})
    return out


# ----------------------------------------------------------------------------- loss

# Upstream's LM objective: next-token cross-entropy on `model.apply(params, tokens)` with its default (causal) mask.
# A random batch has no prompt/target split, so every real label is a target: weight 1 where the label is neither
# padding nor outside the output vocabulary (out_vocab keeps only the first rows of the tied head).


def loss_arrays(batch: Batch, config: TransformerConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs (B, T-1), labels (B, T-1), weights (B, T-1) float32)."""
    tokens = batch.tokens
    if tokens.shape[1] < 2:
        raise NeedleTwinError(f"gradient parity needs --seq-len >= 2 (inputs and next-token labels), got "
                              f"{tokens.shape[1]}")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    real = (labels != config.pad_token_id) & (labels < config.output_vocab)
    return inputs, np.where(real, labels, 0), real.astype(np.float32)


@functools.lru_cache(maxsize=8)
def _flax_value_and_grad(config: TransformerConfig):
    model = FlaxModel(config)

    def loss_fn(params, inputs, labels, weights):
        logits = model.apply({"params": params}, inputs)  # (B, T-1, V_out) float32, causal mask
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # (B, T-1)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    return jax.jit(jax.value_and_grad(loss_fn))


def flax_loss_and_grads(twins: Twins, batch: Batch) -> tuple[float, dict[str, np.ndarray]]:
    arrays = loss_arrays(batch, twins.config)
    loss, grads = _flax_value_and_grad(twins.config)(twins.flax_params, *(twins.to_jax(a) for a in arrays))
    # The heads never reach the LM loss: zero gradients in jax, none (reported as zeros) in torch.
    return float(loss), {k: np.asarray(v) for k, v in flatten_tree(jax.device_get(grads)).items()}


def torch_loss(twins: Twins, batch: Batch) -> torch.Tensor:
    inputs, labels, weights = (torch.from_numpy(np.ascontiguousarray(a)).to(twins.torch_device)
                               for a in loss_arrays(batch, twins.config))
    logits = twins.torch_model(inputs.long())  # causal mask by default, as upstream's __call__
    nll = F.cross_entropy(logits.transpose(1, 2), labels.long(), reduction="none")  # (B, T-1)
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)
