"""Needle v1's parity adapter: what the engine, reports and CLI use of this family."""

from __future__ import annotations

from convert.v1.config import SPECIAL_IDS
from convert.v1.family import FAMILY
from needle_flax.v1 import SimpleAttentionNetwork as FlaxModel
from parity_tests.adapter import Adapter
from parity_tests.v1 import inputs, runs
from parity_tests.v1.generate_command import generate
from parity_tests.v1.tolerances import BUDGETS


class V1Adapter(Adapter):
    family = FAMILY
    budgets = BUDGETS
    special_ids = SPECIAL_IDS
    flax_model = staticmethod(FlaxModel)
    torch_model = staticmethod(runs.torch_model)
    probe_table = staticmethod(runs.table)
    flax_probes = staticmethod(runs.flax_probes)
    torch_probes = staticmethod(runs.torch_probes)
    flax_loss_and_grads = staticmethod(runs.flax_loss_and_grads)
    torch_loss = staticmethod(runs.torch_loss)
    generation = staticmethod(runs.generation)
    random_batch = staticmethod(inputs.random_batch)
    token_file = staticmethod(inputs.load_token_file)
    text_batch = staticmethod(inputs.text_batch)
    generate = staticmethod(generate)


ADAPTER = V1Adapter()
