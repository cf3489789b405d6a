"""Needle 3's probe table: every named capture point of the lane stack, in execution order.

Per layer: the lanes before it, the routing weights (hpre, then hpost and the Sinkhorn matrix hres), the block
input u, at models with engram sites the gate α of every site (G, B, T), the attention's q/k/v projections and,
with conv taps, q/k/v after the taps, the attention output (before the post-norm and gate), the Monarch MLP output
and the lanes after it (a stage boundary: isolated mode feeds each torch layer the Flax lanes). Passes: "forward"
(__call__), "cells" (hidden_cells), one per head the checkpoint has ("embedding", "confidence", "router": the
pooled vector (B, Q·D) and the head's output), and with `--depth` one "depth{d}" pass per rung d: the exit logits
of `exit_depth=d`, the rung's own logits of `subnetwork_only`, and (d < L) the logits of the sliced rung model
(`ladder_slice`, what `needle build --layers d` deploys) run on its own. "quant" (float32): the logits of
`quant=True`, each side's activation quantiser calls traced for rounding flips.
Return values (logits, cells, heads, rung logits) have no torch module: both runs add them under the probe name.
"""

from __future__ import annotations

from collections.abc import Iterable

from convert.v3.config import TransformerConfig
from parity_tests.probes import Probe

LAYER = ("stack", "layers")
BLOCK = ("stack", "layers", "block")
HEADS = {"embedding": "embedding_head", "confidence": "confidence_head", "router": "router_head"}  # pass: group
# "quant": __call__ with quant=True (upstream's deploy fake-quant), float32 runs only: the torch pass takes the Flax
# code at each rounding flip of an A8 quantiser (parity_tests/flips.py; the report's `flips`), so its logits are
# judged whole.
DEFAULT_PASSES = ("forward", "quant", "cells", *HEADS)
RUNG_OUTPUTS = ("exit_logits", "sub_logits", "sliced_logits")
ATTN = ("self_attn",)


def _layer(i: int, config: TransformerConfig) -> list[Probe]:
    p, t = f"layers.{i}", f"stack.layers.{i}"

    def at(names, path, module):
        return [Probe(f"{p}.{n}", (*path, n), f"{t}{module}.tap_{n}", i, pass_="forward") for n in names]

    out = at(("lanes_in", "hpre", "u"), LAYER, "")
    if config.num_sites:
        out += at(("engram_gate",), BLOCK, ".block")
    out += at(("q", "k", "v"), (*BLOCK, *ATTN), ".block.self_attn")
    if config.qkv_conv_taps:
        out += at(("q_conv", "k_conv", "v_conv"), (*BLOCK, *ATTN), ".block.self_attn")
    out += at(("attn_out", "mlp_out"), BLOCK, ".block")
    out += at(("hpost", "hres"), LAYER, "")
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
        table += _layer(i, config)
    table += [Probe("final_hidden", ("stack", "final_hidden"), "stack.tap_final_hidden", boundary=True,
                    pass_="forward"),
              _returned("logits", "forward"), _returned("quant_logits", "quant"), _returned("hidden_cells", "cells")]
    for head, group in HEADS.items():
        if group in groups:
            table += [Probe(f"{head}.pooled", (group, "pooled"), f"{group}.tap_pooled", pass_=head),
                      _returned(head, head)]
    table = [p for p in table if p.pass_ in passes]
    for d in depths:
        outs = RUNG_OUTPUTS if d < config.num_layers else RUNG_OUTPUTS[:2]  # rung L is the model itself
        table += [_returned(f"depth{d}.{out}", f"depth{d}") for out in outs]
    return table
