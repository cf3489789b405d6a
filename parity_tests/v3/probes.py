"""Needle 3's probe table: every named capture point of the lane stack, in execution order.

Per layer: the lanes before it, the routing weights (hpre, then hpost and the Sinkhorn matrix hres), the block
input u, the attention output (before the post-norm and gate), the Monarch MLP output and the lanes after it (a stage
boundary: isolated mode feeds each torch layer the Flax lanes). Passes: "forward" (__call__), "cells"
(hidden_cells), one per head the checkpoint has ("embedding", "confidence", "router"), and with `--depth` one
"depth{d}" pass per rung d: the exit logits of `exit_depth=d` and the rung's own logits of `subnetwork_only`.
Return values (logits, cells, heads, rung logits) have no torch module: both runs add them under the probe name.
"""

from __future__ import annotations

from collections.abc import Iterable

from convert.v3.config import TransformerConfig
from parity_tests.probes import Probe

LAYER = ("stack", "layers")
BLOCK = ("stack", "layers", "block")
HEADS = {"embedding": "embedding_head", "confidence": "confidence_head", "router": "router_head"}  # pass: group
DEFAULT_PASSES = ("forward", "cells", *HEADS)
RUNG_OUTPUTS = ("exit_logits", "sub_logits")


def _layer(i: int) -> list[Probe]:
    p, t = f"layers.{i}", f"stack.layers.{i}"
    out = [Probe(f"{p}.{n}", (*LAYER, n), f"{t}.tap_{n}", i, pass_="forward") for n in ("lanes_in", "hpre", "u")]
    out += [Probe(f"{p}.{n}", (*BLOCK, n), f"{t}.block.tap_{n}", i, pass_="forward") for n in ("attn_out", "mlp_out")]
    out += [Probe(f"{p}.{n}", (*LAYER, n), f"{t}.tap_{n}", i, pass_="forward") for n in ("hpost", "hres")]
    out.append(Probe(f"{p}.lanes_out", (*LAYER, "lanes_out"), f"{t}.tap_lanes_out", i, boundary=True,
                     pass_="forward"))
    return out


def _returned(name: str, pass_: str) -> Probe:
    return Probe(name, (name,), "", pass_=pass_)


def probe_table(config: TransformerConfig, groups: Iterable[str] = tuple(HEADS.values()),
                passes: Iterable[str] = DEFAULT_PASSES, depths: Iterable[int] = ()) -> list[Probe]:
    """Every probe of this config, for the head groups the checkpoint has, the passes and the rungs asked for."""
    groups, passes = set(groups), set(passes)
    table = [Probe("embed", ("embed",), "tap_embed", boundary=True, pass_="forward")]
    if config.num_sites:
        table += [Probe(f"engram_{kv}", (f"engram_{kv}",), f"tap_engram_{kv}", boundary=True, pass_="forward")
                  for kv in ("k", "v")]
    for i in range(config.num_layers):
        table += _layer(i)
    table += [Probe("final_hidden", ("stack", "final_hidden"), "stack.tap_final_hidden", boundary=True,
                    pass_="forward"),
              _returned("logits", "forward"), _returned("hidden_cells", "cells")]
    table += [_returned(head, head) for head, group in HEADS.items() if group in groups]
    table = [p for p in table if p.pass_ in passes]
    for d in depths:
        table += [_returned(f"depth{d}.{out}", f"depth{d}") for out in RUNG_OUTPUTS]
    return table
