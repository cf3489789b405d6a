"""Needle 2's mapping rules: upstream's Flax tree (NEEDLE_V2.md §2) <-> the v2 torch twin's state_dict.

The torch twin holds one module per layer (`stack.layers.{i}`: the layer's Block and its lane
routing parameters), Linear weights as (out, in) and each engram site as `engrams.{g}`.
Upstream stacks the scanned Block's parameters and the `stack/mhc_*` routing parameters on
a leading layer axis; `mtp_block` is one unstacked Block. Three groups are optional, as in
upstream's files: the MTP head (every upstream init makes it; a checkpoint may drop it) and
the two probe heads (made only when a head method runs at init).
"""

from __future__ import annotations

from convert.rules import Rule
from convert.v2.config import ENGRAM_TAPS, TransformerConfig

STACKS = {"L": ("stack", "num_layers")}
SYMBOLS = {"V": "vocab_size", "D": "d_model", "A": "attn_dim", "h": "head dim (A / num_heads)",
           "KH": "num_kv_heads · h", "P": "Hadamard width (smallest power of two >= D)", "L": "num_layers",
           "n": "mhc_lanes", "nD": "n · D", "nn": "n²", "N": "engram tables (|orders| · engram heads)",
           "S": "engram_slots", "s": "engram sub_dim (D // N)", "Ns": "N · s", "taps": "4 conv taps", "2D": "2 · D",
           "C": "contrastive_dim", "pc": "4 contrastive probes", "pcD": "4 · D", "pk": "8 confidence probes",
           "pkD": "8 · D", "1": "one output"}
GROUPS = ("mtp", "contrastive", "confidence")
DEFAULT_GROUPS = ("mtp",)  # what upstream's plain `model.init(key, tokens)` creates
CONTRASTIVE_PROBES, CONFIDENCE_PROBES = 4, 8


def dims(config: TransformerConfig) -> dict[str, int]:
    D, n, N, s = config.d_model, config.mhc_lanes, config.num_engram_tables, config.engram_sub_dim
    return {
        "V": config.vocab_size, "D": D, "A": config.attn_dim, "h": config.head_dim, "KH": config.kv_dim,
        "P": config.hada_dim, "L": config.num_layers, "n": n, "nD": n * D, "nn": n * n,
        "N": N, "S": config.engram_slots, "s": s, "Ns": N * s, "taps": ENGRAM_TAPS, "2D": 2 * D,
        "C": config.contrastive_dim, "pc": CONTRASTIVE_PROBES, "pcD": CONTRASTIVE_PROBES * D,
        "pk": CONFIDENCE_PROBES, "pkD": CONFIDENCE_PROBES * D, "1": 1,
    }


def block(flax: str, torch: str, stack: str | None, group: str | None) -> list[Rule]:
    """One Block: the attention branch (sandwich-normed, gated) and the Hadamard MLP branch."""
    attn = {"q_proj": ("D", "A"), "k_proj": ("D", "KH"), "v_proj": ("D", "KH")}
    out = [Rule(f"{flax}/ZCRMSNorm_0/scale", f"{torch}.pre_attn_norm.scale", ("D",), False, stack, group)]
    out += [Rule(f"{flax}/self_attn/{p}/kernel", f"{torch}.self_attn.{p}.weight", s, True, stack, group)
            for p, s in attn.items()]
    out += [Rule(f"{flax}/self_attn/{n}/scale", f"{torch}.self_attn.{n}.scale", ("h",), False, stack, group)
            for n in ("q_norm", "k_norm")]
    out += [
        Rule(f"{flax}/self_attn/gate_proj/kernel", f"{torch}.self_attn.gate_proj.weight", ("D", "A"), True, stack,
             group),
        Rule(f"{flax}/self_attn/out_proj/kernel", f"{torch}.self_attn.out_proj.weight", ("A", "D"), True, stack,
             group),
        Rule(f"{flax}/post_attn_norm/scale", f"{torch}.post_attn_norm.scale", ("D",), False, stack, group),
        Rule(f"{flax}/attn_gate", f"{torch}.attn_gate", (), False, stack, group),
        Rule(f"{flax}/pre_hada_norm/scale", f"{torch}.pre_hada_norm.scale", ("D",), False, stack, group),
    ]
    out += [Rule(f"{flax}/hadamard_mlp/{d}", f"{torch}.hadamard_mlp.{d}", ("P",), False, stack, group)
            for d in ("d1", "d2", "d3")]
    return out


def lanes(i: str = "{i}") -> list[Rule]:
    """Layer i's lane routing: upstream keeps these on `stack` itself, stacked over layers."""
    L = f"stack.layers.{i}"
    out = [Rule(f"stack/mhc_phi_{k}", f"{L}.phi_{k}.weight", ("nD", m), True, "L")
           for k, m in (("pre", "n"), ("post", "n"), ("res", "nn"))]
    out += [Rule(f"stack/mhc_b_{k}", f"{L}.b_{k}", s, False, "L") for k, s in
            (("pre", ("n",)), ("post", ("n",)), ("res", ("n", "n")))]
    out += [Rule(f"stack/mhc_a_{k}", f"{L}.a_{k}", (), False, "L") for k in ("pre", "post", "res")]
    return out


def engram(g: int) -> list[Rule]:
    return [
        Rule(f"engrams_{g}/embedding", f"engrams.{g}.embedding", ("N", "S", "s")),
        Rule(f"engrams_{g}/key_proj/kernel", f"engrams.{g}.key_proj.weight", ("Ns", "D"), True),
        Rule(f"engrams_{g}/value_proj/kernel", f"engrams.{g}.value_proj.weight", ("Ns", "D"), True),
        Rule(f"engrams_{g}/taps", f"engrams.{g}.taps", ("taps", "D")),
    ]


def rules(config: TransformerConfig) -> list[Rule]:
    """Every rule of a config, the optional groups included."""
    table = [Rule("embedding/embedding", "embedding.weight", ("V", "D"))]
    table += block("stack/layers/block", "stack.layers.{i}.block", "L", None)
    table += lanes()
    table.append(Rule("stack/final_norm/scale", "stack.final_norm.scale", ("D",)))
    for g in range(config.num_sites):
        table += engram(g)
    table += [
        Rule("mtp_combine/kernel", "mtp_combine.weight", ("2D", "D"), True, group="mtp"),
        Rule("mtp_emb_norm/scale", "mtp_emb_norm.scale", ("D",), group="mtp"),
        Rule("mtp_final_norm/scale", "mtp_final_norm.scale", ("D",), group="mtp"),
        *block("mtp_block", "mtp_block", None, "mtp"),
        Rule("contrastive_head/probes", "contrastive_head.probes", ("pc", "D"), group="contrastive"),
        Rule("contrastive_head/proj/kernel", "contrastive_head.proj.weight", ("pcD", "C"), True, group="contrastive"),
        Rule("contrastive_head/log_temp", "contrastive_head.log_temp", (), group="contrastive"),
        Rule("confidence_head/probes", "confidence_head.probes", ("pk", "D"), group="confidence"),
        Rule("confidence_head/proj/kernel", "confidence_head.proj.weight", ("pkD", "1"), True, group="confidence"),
        Rule("confidence_head/proj/bias", "confidence_head.proj.bias", ("1",), group="confidence"),
    ]
    return table
