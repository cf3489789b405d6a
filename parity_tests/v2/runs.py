"""Needle 2's runs for the parity engine: both twins' probes pass by pass, the training loss, greedy generation, the
CLI's generate.

Every pass uses the mask of a right-padded batch, causal ∧ padding (what hidden_cells and the heads build
themselves), so pads never reach a real position and each pass's lanes are the same in both twins.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from convert.errors import GenerationError, NeedleTwinError
from convert.rules import TORCH
from convert.trees import flatten_tree
from convert.v2.chat import batched_generate_cap
from convert.v2.config import BOS_ID, EOS_ID, TransformerConfig
from convert.v2.family import FAMILY
from needle_flax import layers as flax_layers
from needle_flax.v2 import SimpleAttentionNetwork as FlaxModel
from needle_flax.v2.generate import generate as flax_generate
from needle_flax.v2.generate import generate_recompute as flax_recompute
from needle_torch import layers as torch_layers
from needle_torch.v2 import SimpleAttentionNetwork as TorchModel
from needle_torch.v2.generate import generate as torch_generate
from needle_torch.v2.generate import generate_recompute as torch_recompute
from parity_tests import flips, probes
from parity_tests.generation import generation_config, generation_parity
from parity_tests.inputs import Batch
from parity_tests.twins import Twins
from parity_tests.v2.probes import DEFAULT_PASSES, probe_table


def torch_model(tree: Mapping[str, Any], config: TransformerConfig, dtype: str) -> TorchModel:
    return TorchModel.from_flax(tree, config, dtype)


def prepare(config: TransformerConfig, dtype: str, jax_platform: str) -> tuple[TransformerConfig, str | None]:
    """float16 with the flash path cannot run on XLA's CPU (its dot has no float16 -> float32 accumulation, and
    upstream fails the same way): both twins then run the non-flash attention, the same function in float32."""
    if dtype == "float16" and config.flash and jax_platform == "cpu":
        return config.replace(flash=False), ("float16 on CPU: both twins run the non-flash attention (XLA's CPU dot "
                                             "has no float16 -> float32 accumulation for the flash path)")
    return config, None


def groups(twins: Twins) -> tuple[str, ...]:
    """The optional groups both twins hold (the torch twin was built from the tree, so it has exactly those)."""
    return FAMILY.groups_in(twins.torch_model.state_dict(), TORCH, twins.config)


def table(twins: Twins, passes=DEFAULT_PASSES) -> list[probes.Probe]:
    if twins.config.dtype != "float32":  # the flip margins are float32 noise; a half-precision run has no quant pass
        passes = tuple(p for p in passes if p != "quant")
    return probe_table(twins.config, groups(twins), passes)


# ----------------------------------------------------------------------------- probes


@functools.lru_cache(maxsize=16)
def _flax_passes(config: TransformerConfig, passes: tuple[str, ...], mtp: bool):
    """jit(params, tokens) -> {pass: intermediates}; the cells pass adds its return value as "hidden_cells"."""
    model, pad = FlaxModel(config), config.pad_token_id
    mutable = [flax_layers.PROBES]

    def run(params, tokens):
        mask = flax_layers.make_attention_mask(tokens, pad)
        out = {}
        for name in passes:
            if name in ("forward", "quant"):
                _, col = model.apply({"params": params}, tokens, mask, name == "quant", mtp and name == "forward",
                                     mutable=mutable)
            elif name == "cells":
                cells, col = model.apply({"params": params}, tokens, method="hidden_cells", mutable=mutable)
                col = {flax_layers.PROBES: {**col[flax_layers.PROBES], "hidden_cells": (cells,)}}
            else:
                method = "encode_contrastive" if name == "contrastive" else "forward_confidence"
                _, col = model.apply({"params": params}, tokens, method=method, mutable=mutable)
            out[name] = col[flax_layers.PROBES]
        return out

    return jax.jit(run)


def _passes(twins: Twins, table: list[probes.Probe]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.pass_ for p in table))


def flax_probes(twins: Twins, batch: Batch, passes=DEFAULT_PASSES) -> dict[str, np.ndarray]:
    """Every probe of the Flax twin, one jitted function over the passes; the quant pass apart, traced."""
    probe_list = table(twins, passes)
    plain = tuple(p for p in _passes(twins, probe_list) if p != "quant")
    run = _flax_passes(twins.config, plain, "mtp" in groups(twins))
    tokens = twins.to_jax(batch.tokens)
    collections = jax.device_get(run(twins.flax_params, tokens))
    if "quant" in _passes(twins, probe_list):
        collections["quant"] = _flax_quant(twins, tokens)
    return probes.flax_probes(probe_list, collections)


def _flax_quant(twins: Twins, tokens) -> dict:
    """The quant pass's sown probes, the quantiser calls recorded for flips.rounding_flips. A fresh jit inside the
    trace (a cached one has no callbacks)."""
    model, pad, mutable = FlaxModel(twins.config), twins.config.pad_token_id, [flax_layers.PROBES]

    def run(params, tokens):
        mask = flax_layers.make_attention_mask(tokens, pad)
        return model.apply({"params": params}, tokens, mask, True, False, mutable=mutable)[1][flax_layers.PROBES]

    with flips.trace_flax("v2") as calls:
        collection = jax.device_get(jax.jit(run)(twins.flax_params, tokens))
    flips.record(twins, "flax", calls)
    return collection


def torch_probes(twins: Twins, batch: Batch, substitute: Mapping[str, np.ndarray] | None = None,
                 passes=DEFAULT_PASSES) -> dict[str, np.ndarray]:
    """Every probe of the torch twin, pass by pass; with `substitute`, boundary outputs take those values."""
    model, probe_list = twins.torch_model, table(twins, passes)
    tokens = torch.from_numpy(batch.tokens).long().to(twins.torch_device)
    mask = torch_layers.make_attention_mask(tokens, twins.config.pad_token_id)
    mtp = "mtp" in groups(twins)
    calls = {"forward": lambda: model(tokens, mask, False, mtp), "quant": lambda: _torch_quant(twins, tokens, mask),
             "cells": lambda: model.hidden_cells(tokens), "contrastive": lambda: model.encode_contrastive(tokens),
             "confidence": lambda: model.forward_confidence(tokens)}
    out: dict[str, np.ndarray] = {}
    with torch.inference_mode():
        for name in _passes(twins, probe_list):
            hooked = [p for p in probe_list if p.pass_ == name and p.torch]
            subs = None if substitute is None else {p.name: twins.to_torch(substitute[p.name])
                                                    for p in hooked if p.boundary}
            with probes.torch_capture(model, hooked, subs) as captured:
                value = calls[name]()
            out.update({k: t.float().cpu().numpy() for k, t in captured.items()})
            if name == "cells":
                out["hidden_cells"] = value.float().cpu().numpy()
    return out


def _torch_quant(twins: Twins, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The quant pass, aligned to the Flax side's codes at each rounding flip (flips.trace_torch)."""
    with flips.trace_torch(twins.torch_model, align=flips.reference_calls(twins)) as calls:
        logits = twins.torch_model(tokens, mask, True)
    flips.record(twins, "torch", calls)
    return logits


# ----------------------------------------------------------------------------- loss

# Upstream's fine-tuning objective (NEEDLE_V2.md §7.2, §8): next-token cross-entropy over the target tokens, on
# `model.apply(params, tokens)` with its default (causal) mask. A random batch has no prompt/target split, so every
# real label is a target: weights = 1 where the label is not padding.


def loss_arrays(batch: Batch, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs (B, T-1), labels (B, T-1), weights (B, T-1) float32)."""
    tokens = batch.tokens
    if tokens.shape[1] < 2:
        raise NeedleTwinError(f"gradient parity needs --seq-len >= 2 (inputs and next-token labels), got "
                              f"{tokens.shape[1]}")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    return inputs, labels, (labels != pad_id).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _flax_value_and_grad(config: TransformerConfig):
    model = FlaxModel(config)

    def loss_fn(params, inputs, labels, weights):
        logits = model.apply({"params": params}, inputs)  # (B, T-1, V) float32, causal mask (upstream's default)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]  # (B, T-1)
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    return jax.jit(jax.value_and_grad(loss_fn))


def flax_loss_and_grads(twins: Twins, batch: Batch) -> tuple[float, dict[str, np.ndarray]]:
    inputs, labels, weights = loss_arrays(batch, twins.config.pad_token_id)
    loss, grads = _flax_value_and_grad(twins.config)(twins.flax_params, *(twins.to_jax(a) for a in
                                                                          (inputs, labels, weights)))
    flat = {k: np.asarray(v) for k, v in flatten_tree(jax.device_get(grads)).items()}
    # Parameters the LM loss never reaches (the heads; MTP when not asked for) get no gradient in jax either.
    return float(loss), flat


def torch_loss(twins: Twins, batch: Batch) -> torch.Tensor:
    inputs, labels, weights = (torch.from_numpy(np.ascontiguousarray(a)).to(twins.torch_device)
                               for a in loss_arrays(batch, twins.config.pad_token_id))
    logits = twins.torch_model(inputs.long())  # causal mask by default, as upstream's __call__
    nll = F.cross_entropy(logits.transpose(1, 2), labels.long(), reduction="none")  # (B, T-1)
    return (nll * weights).sum() / weights.sum().clamp(min=1.0)


# ----------------------------------------------------------------------------- generation


def left_padded(tokens: np.ndarray, pad: int, cap: int) -> np.ndarray:
    """A right-padded batch (B, T) as upstream's `batched_generate` lays prompts out: each row's ids cut to its
    first `cap` (`batched_generate_cap`), then left-padded with pad to the longest row.

    A fully padded row becomes [BOS] (every upstream prompt starts with it)."""
    rows = [row[row != pad][:cap] for row in np.asarray(tokens)]
    rows = [r if r.size else np.array([BOS_ID], r.dtype) for r in rows]
    out = np.full((len(rows), max(r.size for r in rows)), pad, np.int64)
    for i, r in enumerate(rows):
        out[i, out.shape[1] - r.size:] = r
    return out


def generation(twins: Twins, batch: Batch, max_new_tokens: int, suppress_tokens: Iterable[int] | None = None
               ) -> dict[str, Any]:
    """Greedy generation parity: both twins' cached decoding (prefill, then steps over the KV cache) and upstream's
    recompute loop (run.py), from the batch's prompts cut and left-padded as upstream's batched path lays them out.

    Each run's tokens are reported as (B, 1 + steps): the prompt's last token (fed at step 0), then the chosen ones.
    Needle 2 decoding has no suppressed ids (upstream's has none); asking for some is an error."""
    if suppress_tokens:
        raise NeedleTwinError("Needle 2's decoding has no suppressed ids (upstream's has none); drop "
                              "--suppress-special")
    pad = twins.config.pad_token_id
    prompts = left_padded(batch.arrays["tokens"], pad, batched_generate_cap(twins.config.max_seq_len, max_new_tokens))
    kw = dict(eos_token_id=EOS_ID, pad_token_id=pad, return_logits=True)

    def run(tokens, logits) -> tuple[np.ndarray, np.ndarray]:
        new = np.asarray(tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens).astype(np.int64)
        logits = np.asarray(logits.cpu() if isinstance(logits, torch.Tensor) else logits)
        return np.concatenate([prompts[:, -1:], new], axis=1), logits

    flax_in = prompts.astype(np.int32)
    torch_in = torch.from_numpy(prompts).to(twins.torch_device)
    cached = {"flax": run(*flax_generate(twins.flax_model, twins.flax_params, flax_in, max_new_tokens, **kw)),
              "torch": run(*torch_generate(twins.torch_model, torch_in, max_new_tokens, **kw))}
    recompute = {"flax": run(*flax_recompute(twins.flax_model, twins.flax_params, flax_in, max_new_tokens, **kw)),
                 "torch": run(*torch_recompute(twins.torch_model, torch_in, max_new_tokens, **kw))}
    return generation_parity(cached, recompute, pad, max_new_tokens)


def generate_from_checkpoint(checkpoint, prompt_ids: Sequence[int], *, backend: str = "torch",
                             dtype: str | None = None, max_new_tokens: int = 96, kv_window: int = 0,
                             sink: Sequence[bool] | None = None, temperature: float = 0.0, seed: int | None = None,
                             streamer=None, compile: bool = False) -> list[int]:
    """Decode one prompt (BOS included) with a loaded Needle 2 `convert.io.Checkpoint`; the new ids, EOS included
    when it came (the pads after it dropped).

    Defaults are upstream's `generate_cached`: greedy, 96 new tokens, no window; the buffer is the prompt plus the
    new tokens (capped by max_seq_len as upstream's max_len is, so fewer come when the prompt is long). dtype:
    None = the checkpoint config's; float32 pins full-precision matmuls in both frameworks (upstream's decode runs
    in float32). sink: a bool per prompt position kept visible under kv_window. streamer: called with each new id
    (int) as it is chosen, until EOS. compile: torch only, one torch.compile graph per step.
    """
    config = generation_config(checkpoint.config, backend, dtype, compile)
    dtype = config.dtype
    room = config.max_seq_len - len(prompt_ids)
    if room < 1:
        raise GenerationError(f"the prompt has {len(prompt_ids)} ids, the model's max_seq_len is "
                              f"{config.max_seq_len}: no room for a new token; shorten the prompt")
    steps = min(max_new_tokens, room) if isinstance(max_new_tokens, int) and max_new_tokens >= 1 else max_new_tokens
    stopped = False

    def emit(step_tokens) -> None:
        nonlocal stopped
        if streamer is not None and not stopped:
            token = int(np.asarray(step_tokens)[0])
            streamer(token)
            stopped = token == EOS_ID

    args = dict(kv_window=kv_window, temperature=temperature, seed=seed, eos_token_id=EOS_ID,
                pad_token_id=config.pad_token_id, streamer=emit)
    if sink is not None:
        args["sink"] = np.asarray([sink], bool)
    if backend == "torch":
        if dtype == "float32":
            torch.set_float32_matmul_precision("highest")
        model = TorchModel.from_flax(checkpoint.params, config, dtype=dtype)
        tokens = torch_generate(model, [list(prompt_ids)], steps, **args, compile=compile)
    else:
        if dtype == "float32":
            jax.config.update("jax_default_matmul_precision", "highest")
        params = jax.tree.map(lambda a: jnp.asarray(a, dtype), checkpoint.params)  # upstream casts every param
        tokens = flax_generate(FlaxModel(config), params, [list(prompt_ids)], steps, **args)
    ids = [int(t) for t in np.asarray(tokens)[0]]
    return ids[:ids.index(EOS_ID) + 1] if EOS_ID in ids else ids
