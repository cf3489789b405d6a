"""Needle 3's LoRA gradient parity (parity_tests.lora): its Flax model and LM loss, its adapter in PEFT's terms."""

from __future__ import annotations

from convert.v3.lora import as_v2
from needle_flax.v3 import SimpleAttentionNetwork as FlaxModel
from parity_tests.lora import LoraFamily
from parity_tests.v3.runs import loss_arrays, torch_loss

LORA = LoraFamily(FlaxModel, loss_arrays, torch_loss, as_v2)
lora_gradient_parity = LORA.gradients
