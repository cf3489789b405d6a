"""Needle 3's parity adapter: what the engine, reports and CLI use of this family."""

from __future__ import annotations

from convert.v3.family import FAMILY
from needle_flax.v3 import SimpleAttentionNetwork as FlaxModel
from parity_tests import flips
from parity_tests.adapter import Adapter
from parity_tests.v3 import inputs, runs
from parity_tests.v3.lora import lora_gradient_parity
from parity_tests.v3.tolerances import BUDGETS


class V3Adapter(Adapter):
    family = FAMILY
    budgets = BUDGETS
    special_ids = ()
    flax_model = staticmethod(FlaxModel)
    torch_model = staticmethod(runs.torch_model)
    probe_table = staticmethod(runs.table)
    flax_probes = staticmethod(runs.flax_probes)
    torch_probes = staticmethod(runs.torch_probes)
    flax_loss_and_grads = staticmethod(runs.flax_loss_and_grads)
    torch_loss = staticmethod(runs.torch_loss)
    random_batch = staticmethod(inputs.random_batch)
    token_file = staticmethod(inputs.load_token_file)
    text_batch = staticmethod(inputs.text_batch)
    depths = staticmethod(runs.parse_depth)
    lora_gradients = staticmethod(lora_gradient_parity)
    rounding_flips = staticmethod(flips.rounding_flips)


ADAPTER = V3Adapter()
