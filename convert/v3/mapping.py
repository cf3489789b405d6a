"""Needle 3's mapping rules: upstream's Flax tree (NEEDLE_V3.md §2) <-> the v3 torch twin's state_dict.

As for Needle 2, the torch twin holds one module per layer (`stack.layers.{i}`: its Block and its lane routing
parameters), Linear weights as (out, in) and each engram site as `engrams.{g}`; upstream stacks the scanned Block
and the `stack/mhc_*` parameters on a leading layer axis. The conv taps exist when qkv_conv_taps > 0 and the
engram sites are the config's. Four groups are optional: the three probe heads (made only when a head method runs
at init) and the router's calibration vector (a leaf no module creates; only the `.cact` export reads it).
"""

from __future__ import annotations

from convert.rules import Rule
from convert.v2.mapping import engram, lanes  # Needle 3 keeps Needle 2's lane routing and engram tables
from convert.v3.config import ENGRAM_TAPS, HADA_COND_RANK, TransformerConfig

STACKS = {"L": ("stack", "num_layers")}
SYMBOLS = {"V": "vocab_size", "D": "d_model", "hq": "qk head dim", "Hq": "num_heads · hq", "Kq": "num_kv_heads · hq",
           "Kv": "num_kv_heads · v head dim", "Hv": "num_heads · v head dim", "τ": "qkv_conv_taps",
           "P": "Hadamard width (smallest power of two >= D)", "a": "Monarch factor A's size", "b": "Monarch factor "
           "B's size (a·b = P)", "r": "8, the MLP's conditioning rank", "L": "num_layers", "n": "mhc_lanes",
           "nD": "n · D", "nn": "n²", "N": "engram tables (|orders| · engram heads)", "S": "engram_slots",
           "s": "engram sub_dim (D // N)", "Ns": "N · s", "taps": "4 engram conv taps", "L1": "num_layers + 1 cell "
           "rows", "ke": "embedding_probes", "Qe": "embedding_queries", "QeD": "Qe · D", "c": "embedding_dim",
           "kc": "confidence_probes", "Qc": "confidence_queries", "QcD": "Qc · D", "kr": "router_probes",
           "Qr": "router_queries", "QrD": "Qr · D", "1": "one output", "3": "three router outputs"}
HEADS = {"embedding_head": ("ke", "Qe", "QeD", "c"), "confidence_head": ("kc", "Qc", "QcD", "1"),
         "router_head": ("kr", "Qr", "QrD", "3")}
GROUPS = (*HEADS, "router_calibration")
DEFAULT_GROUPS: tuple[str, ...] = ()  # upstream's plain `model.init(key, tokens)` makes no head


def dims(config: TransformerConfig) -> dict[str, int]:
    D, n, H, K = config.d_model, config.mhc_lanes, config.num_heads, config.num_kv_heads
    hq, hv = config.head_dims
    N, s = config.num_engram_tables, config.engram_sub_dim
    a, b = config.hada_blocks
    out = {"V": config.vocab_size, "D": D, "hq": hq, "Hq": H * hq, "Kq": K * hq, "Kv": K * hv, "Hv": H * hv,
           "τ": config.qkv_conv_taps, "P": config.hada_dim, "a": a, "b": b, "r": HADA_COND_RANK,
           "L": config.num_layers, "n": n, "nD": n * D, "nn": n * n, "N": N, "S": config.engram_slots, "s": s,
           "Ns": N * s, "taps": ENGRAM_TAPS, "L1": config.num_layers + 1, "c": config.embedding_dim, "1": 1, "3": 3}
    for head, (k, q, qd, _) in HEADS.items():
        name = head.removesuffix("_head")
        out[k], out[q] = getattr(config, f"{name}_probes"), getattr(config, f"{name}_queries")
        out[qd] = out[q] * D
    return out


def block(config: TransformerConfig) -> list[Rule]:
    """One Block: the attention branch (conv-tapped, sandwich-normed, gated) and the Monarch MLP branch."""
    f, t = "stack/layers/block", "stack.layers.{i}.block"

    def rule(flax: str, torch: str, shape: tuple[str, ...], transpose: bool = False) -> Rule:
        return Rule(f"{f}/{flax}", f"{t}.{torch}", shape, transpose, "L")

    out = [rule("ZCRMSNorm_0/scale", "pre_attn_norm.scale", ("D",))]
    out += [rule(f"self_attn/{p}/kernel", f"self_attn.{p}.weight", ("D", w), True)
            for p, w in (("q_proj", "Hq"), ("k_proj", "Kq"), ("v_proj", "Kv"))]
    if config.qkv_conv_taps:
        out += [rule(f"self_attn/{p}_taps", f"self_attn.{p}_taps", ("τ", w))
                for p, w in (("q", "Hq"), ("k", "Kq"), ("v", "Kv"))]
    out += [rule(f"self_attn/{p}/scale", f"self_attn.{p}.scale", ("hq",)) for p in ("q_norm", "k_norm")]
    out += [
        rule("self_attn/gate_proj/kernel", "self_attn.gate_proj.weight", ("D", "Hv"), True),
        rule("self_attn/out_proj/kernel", "self_attn.out_proj.weight", ("Hv", "D"), True),
        rule("post_attn_norm/scale", "post_attn_norm.scale", ("D",)),
        rule("attn_gate", "attn_gate", ()),
        rule("pre_hada_norm/scale", "pre_hada_norm.scale", ("D",)),
    ]
    out += [rule(f"hadamard_mlp/w{k}{side}", f"hadamard_mlp.w{k}{side}", (side, side))
            for k in (1, 2, 3) for side in ("a", "b")]
    out += [rule(f"hadamard_mlp/{d}", f"hadamard_mlp.{d}", ("P",)) for d in ("d1", "d2", "b2", "d3", "d4")]
    out += [rule("hadamard_mlp/cond_v", "hadamard_mlp.cond_v.weight", ("D", "r"), True),
            rule("hadamard_mlp/cond_u", "hadamard_mlp.cond_u.weight", ("r", "P"), True)]
    return out


def head(name: str) -> list[Rule]:
    """A probe head: per-layer-row probes and gains, queries, row biases and the projection."""
    k, q, qd, out = HEADS[name]
    rules = [Rule(f"{name}/probes", f"{name}.probes", ("L1", k, "D"), group=name),
             Rule(f"{name}/gain", f"{name}.gain", ("L1", k), group=name),
             Rule(f"{name}/query", f"{name}.query", (q, "D"), group=name),
             Rule(f"{name}/row_bias", f"{name}.row_bias", (q, "L1", k), group=name),
             Rule(f"{name}/proj/kernel", f"{name}.proj.weight", (qd, out), True, group=name)]
    if name == "embedding_head":  # no projection bias; two training-only scalars
        return rules + [Rule(f"{name}/log_temp", f"{name}.log_temp", (), group=name),
                        Rule(f"{name}/bias", f"{name}.bias", (), group=name)]
    return rules + [Rule(f"{name}/proj/bias", f"{name}.proj.bias", (out,), group=name)]


def rules(config: TransformerConfig) -> list[Rule]:
    """Every rule of a config, the optional groups included."""
    table = [Rule("embedding/embedding", "embedding.weight", ("V", "D"))]
    table += block(config)
    table += lanes()
    table.append(Rule("stack/final_norm/scale", "stack.final_norm.scale", ("D",)))
    for g in range(config.num_sites):
        table += engram(g)
    for name in HEADS:
        table += head(name)
    table.append(Rule("router_head/calibration", "router_head.calibration", ("3",), group="router_calibration"))
    return table
