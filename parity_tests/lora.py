"""LoRA gradient parity: every adapter A and B, Flax against torch, on upstream's fine-tuning loss.

Flax differentiates upstream's own formulation: the loss of `model.apply(merge_lora(params, lora, scale))`, the
merge inside the loss (`W + cast(scale·A@B)`), gradients w.r.t. A and B only. torch differentiates PEFT's: the
base frozen, `lora_B(lora_A(x))·scale` added to each target's output. The two are the same function of A and B;
the gradients are compared in upstream's layout (A (L, in, r), B (L, r, out)) per target, and as one vector.

Needle 2 and Needle 3 share the targets, the merge rule and PEFT's module names; a family supplies its Flax model,
its loss (inputs, labels, weights and the torch side's loss) and its adapter in Needle 2's PEFT terms (`LoraFamily`).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from convert.errors import NeedleTwinError
from convert.trees import flatten_tree, unflatten_tree
from convert.v2.lora import Adapter as PeftAdapter
from convert.v2.lora import module_name
from needle_torch.v2.peft import peft_model
from parity_tests.gradients import compare_gradients
from parity_tests.inputs import Batch
from parity_tests.report import GradientResult
from parity_tests.twins import Twins


@dataclass(frozen=True)
class LoraFamily:
    """What LoRA gradient parity needs of a family. loss_arrays(batch, config) -> (inputs, labels, weights) of the
    LM loss; torch_loss(twins, batch) -> that loss on twins.torch_model; peft_adapter(adapter) -> the adapter as a
    convert.v2.lora.Adapter (PEFT's layout is the same for both families)."""

    flax_model: type
    loss_arrays: Callable[[Batch, Any], tuple[np.ndarray, np.ndarray, np.ndarray]]
    torch_loss: Callable[[Twins, Batch], torch.Tensor]
    peft_adapter: Callable[[Any], PeftAdapter]

    def gradients(self, twins: Twins, batch: Batch, adapter: Any) -> GradientResult:
        return lora_gradient_parity(self, twins, batch, adapter)


@functools.lru_cache(maxsize=8)
def _flax_lora_value_and_grad(flax_model: type, config: Any, targets: tuple[str, ...]):
    model = flax_model(config)

    def loss_fn(lora, params, scale, inputs, labels, weights):
        flat = flatten_tree(params)
        for path in targets:  # upstream's merge_lora, inside the loss: W + cast_W(scale · A @ B)
            w = flat[path]
            flat[path] = w + (scale * jnp.matmul(lora[path]["A"], lora[path]["B"])).astype(w.dtype)
        logits = model.apply({"params": unflatten_tree(flat)}, inputs)  # causal mask, as upstream's finetune
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)

    return jax.jit(jax.value_and_grad(loss_fn))


def flax_lora_grads(family: LoraFamily, twins: Twins, batch: Batch, adapter: PeftAdapter
                    ) -> tuple[float, dict[str, np.ndarray]]:
    """Loss and {"<target>/A" | "<target>/B": gradient} in upstream's layout."""
    lora = {t: {k: jnp.asarray(ab[k], jnp.float32) for k in ("A", "B")} for t, ab in adapter.lora.items()}
    arrays = [twins.to_jax(a) for a in family.loss_arrays(batch, twins.config)]
    fn = _flax_lora_value_and_grad(family.flax_model, twins.config, tuple(adapter.lora))
    loss, grads = fn(lora, twins.flax_params, jnp.float32(adapter.scale), *arrays)
    grads = jax.device_get(grads)
    return float(loss), {f"{t}/{k}": np.asarray(grads[t][k]) for t in adapter.lora for k in ("A", "B")}


def torch_lora_grads(family: LoraFamily, twins: Twins, batch: Batch, adapter: PeftAdapter
                     ) -> tuple[float, dict[str, np.ndarray]]:
    """The same through PEFT on a copy of the torch twin (PEFT wraps its model in place): lora_A.weight (r, in) =
    A[i]ᵀ, lora_B.weight (out, r) = B[i]ᵀ."""
    model = peft_model(copy.deepcopy(twins.torch_model), adapter).to(twins.torch_device)
    layered = Twins(twins.adapter, twins.config, twins.flax_model, twins.flax_params, model, twins.jax_device,
                    twins.torch_device)
    named = dict(model.named_parameters())
    for name, param in named.items():  # PEFT loads an adapter for inference (frozen): train only A and B
        param.requires_grad_(".lora_A." in name or ".lora_B." in name)
    with torch.enable_grad():
        loss = family.torch_loss(layered, batch)
        loss.backward()
    out: dict[str, np.ndarray] = {}
    for target in adapter.lora:
        for which in ("A", "B"):
            layers = []
            for i in range(adapter.num_layers):
                param = named[f"base_model.model.{module_name(target, i)}.lora_{which}.default.weight"]
                layers.append(param.grad.detach().float().cpu().numpy().T)
            out[f"{target}/{which}"] = np.stack(layers)
    return float(loss.detach()), out


def lora_gradient_parity(family: LoraFamily, twins: Twins, batch: Batch, adapter: Any) -> GradientResult:
    """Unjudged per-tensor metrics of the adapter's gradients (torch = test, Flax = reference).

    float32 only: in half precision PEFT keeps A and B in float32 beside the bf16 weights, while upstream merges
    them into the bf16 weights, so the two are no longer the same function."""
    if twins.config.dtype != "float32":
        raise NeedleTwinError(f"LoRA gradient parity runs in float32 (PEFT keeps the adapter in float32 beside "
                              f"{twins.config.dtype} weights, upstream merges into them); use --dtype float32")
    peft_adapter = family.peft_adapter(adapter)
    loss_f, ref = flax_lora_grads(family, twins, batch, peft_adapter)
    loss_t, test = torch_lora_grads(family, twins, batch, peft_adapter)
    return GradientResult(loss_f, loss_t, *compare_gradients(test, ref))
