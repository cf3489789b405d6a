"""Needle 2's parity adapter: what the engine, reports and CLI use of this family."""

from __future__ import annotations

from needle_flax.v2 import SimpleAttentionNetwork as FlaxModel
from parity_tests.adapter import Adapter
from parity_tests.v2 import inputs, runs
from parity_tests.v2.lora import lora_gradient_parity
from parity_tests.v2.tolerances import BUDGETS

ADAPTER = Adapter(
    family="v2",
    flax_model=FlaxModel,
    torch_model=runs.torch_model,
    probe_table=runs.table,
    flax_probes=runs.flax_probes,
    torch_probes=runs.torch_probes,
    flax_loss_and_grads=runs.flax_loss_and_grads,
    torch_loss=runs.torch_loss,
    generation=runs.generation,
    random_batch=inputs.random_batch,
    token_file=inputs.load_token_file,
    text_batch=inputs.text_batch,
    budgets=BUDGETS,
    lora_gradients=lora_gradient_parity,
    prepare=runs.prepare,
    special_ids=(),  # upstream's Needle 2 decoding suppresses no ids (a random model's prompt ends in a plain id)
    lengths=inputs.LENGTHS,
)
