"""Needle v1's parity adapter: what the engine, reports and CLI use of this family."""

from __future__ import annotations

from convert.v1.config import SPECIAL_IDS
from needle_flax.v1 import SimpleAttentionNetwork as FlaxModel
from parity_tests.adapter import Adapter
from parity_tests.v1 import inputs, runs
from parity_tests.v1.tolerances import BUDGETS

ADAPTER = Adapter(
    family="v1",
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
    special_ids=SPECIAL_IDS,
    lengths=inputs.LENGTHS,
)
