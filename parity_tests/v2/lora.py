"""Needle 2's LoRA gradient parity (parity_tests.lora): its Flax model and LM loss; its adapters are PEFT's own."""

from __future__ import annotations

from needle_flax.v2 import SimpleAttentionNetwork as FlaxModel
from parity_tests.lora import LoraFamily
from parity_tests.v2.runs import loss_arrays, torch_loss

LORA = LoraFamily(FlaxModel, lambda batch, config: loss_arrays(batch, config.pad_token_id), torch_loss,
                  lambda adapter: adapter)
lora_gradient_parity = LORA.gradients
