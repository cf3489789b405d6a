"""Needle 2's parity adapter: what the engine, reports and CLI use of this family."""

from __future__ import annotations

from convert.v2.family import FAMILY
from needle_flax.v2 import SimpleAttentionNetwork as FlaxModel
from parity_tests import flips
from parity_tests.adapter import Adapter
from parity_tests.v2 import inputs, runs
from parity_tests.v2.generate_command import generate
from parity_tests.v2.lora import lora_gradient_parity
from parity_tests.v2.tolerances import BUDGETS


class V2Adapter(Adapter):
    family = FAMILY
    budgets = BUDGETS
    special_ids = ()  # upstream's Needle 2 decoding suppresses no ids (a random model's prompt ends in a plain id)
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
    lora_gradients = staticmethod(lora_gradient_parity)
    prepare = staticmethod(runs.prepare)
    generate = staticmethod(generate)
    rounding_flips = staticmethod(flips.rounding_flips)


ADAPTER = V2Adapter()
