"""Needle 2's probe table: every named capture point of the lane stack, in execution order.

Per layer: the routing weights (hpre, hpost and the Sinkhorn matrix hres), the block input u, at engram sites
the gate α and the injected memory, the attention output, the block's y and the new lane state (a stage
boundary: isolated mode feeds each torch layer the Flax lanes). Passes: "forward" (__call__ with MTP), "quant"
(the 8-bit activation fake quant, opt-in), "cells" (hidden_cells), "contrastive" and "confidence" (the heads).
"""

from __future__ import annotations

from collections.abc import Iterable

from convert.v2.config import TransformerConfig
from parity_tests.probes import Probe

LAYER = ("stack", "layers")
BLOCK = ("stack", "layers", "block")
# "quant": __call__ with quant=True (the 8-bit activation fake quant), float32 runs only: each side's quantiser calls
# are traced and the torch pass takes the Flax code wherever a value sits within float32 noise of a rounding
# boundary (parity_tests/flips.py; the report's `flips`), so its logits are held to the float32 budget.
DEFAULT_PASSES = ("forward", "quant", "cells", "contrastive", "confidence")


def _layer(i: int, site: bool) -> list[Probe]:
    p, t = f"layers.{i}", f"stack.layers.{i}"
    out = [Probe(f"{p}.{n}", (*LAYER, n), f"{t}.tap_{n}", i, pass_="forward") for n in ("hpre", "hpost", "hres", "u")]
    if site:
        out += [Probe(f"{p}.{n}", (*BLOCK, n), f"{t}.block.tap_{n}", i, pass_="forward")
                for n in ("engram_gate", "engram_inject")]
    out.append(Probe(f"{p}.attn_out", (*BLOCK, "attn_out"), f"{t}.block.tap_attn_out", i, pass_="forward"))
    out.append(Probe(f"{p}.y", (*LAYER, "y"), f"{t}.tap_y", i, pass_="forward"))
    out.append(Probe(f"{p}.state", (*LAYER, "state"), f"{t}.tap_state", i, boundary=True, pass_="forward"))
    return out


def probe_table(config: TransformerConfig, groups: Iterable[str] = ("mtp", "contrastive", "confidence"),
                passes: Iterable[str] = DEFAULT_PASSES) -> list[Probe]:
    """Every probe of this config, for the optional groups the checkpoint has and the passes asked for."""
    groups, passes = set(groups), set(passes)
    table = [Probe("embed", ("embed",), "tap_embed", boundary=True, pass_="forward")]
    if config.num_sites:
        table += [Probe(f"engram_{kv}", (f"engram_{kv}",), f"tap_engram_{kv}", boundary=True, pass_="forward")
                  for kv in ("k", "v")]
    for i in range(config.num_layers):
        table += _layer(i, i in config.engram_layers)
    table += [Probe("final_hidden", ("final_hidden",), "tap_final_hidden", boundary=True, pass_="forward"),
              Probe("logits", ("logits",), "tap_logits", pass_="forward")]
    if "mtp" in groups:
        table.append(Probe("mtp_logits", ("mtp_logits",), "tap_mtp_logits", pass_="forward"))
    if "quant" in passes:
        table.append(Probe("quant_logits", ("logits",), "tap_logits", pass_="quant"))
    if "cells" in passes:  # a method's return value, not a capture: both runs add it under this name
        table.append(Probe("hidden_cells", ("hidden_cells",), "", pass_="cells"))
    for head in ("contrastive", "confidence"):
        if head in groups and head in passes:
            table.append(Probe(head, (head,), f"tap_{head}", pass_=head))
    return [p for p in table if p.pass_ in passes]
