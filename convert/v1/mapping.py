"""Needle v1's mapping rules: the upstream Flax tree (NEEDLE_V1.md) <-> the v1 torch twin's state_dict."""

from __future__ import annotations

from convert.rules import Rule
from convert.v1.config import TransformerConfig

ENCODER = "encoder/layers/EncoderBlock_0"
DECODER = "decoder/layers/DecoderBlock_0"
STACKS = {"Le": ("encoder", "num_encoder_layers"), "Ld": ("decoder", "num_decoder_layers")}
SYMBOLS = {"V": "vocab_size", "D": "d_model", "h": "head dim (D / num_heads)", "KH": "num_kv_heads · h",
           "F": "d_ff", "D4": "d_model // 4", "C": "contrastive_dim", "Le": "num_encoder_layers",
           "Ld": "num_decoder_layers"}


def dims(config: TransformerConfig) -> dict[str, int]:
    return {
        "V": config.vocab_size, "D": config.d_model, "h": config.head_dim,
        "KH": config.num_kv_heads * config.head_dim, "F": config.d_ff,
        "D4": config.d_model // 4, "C": config.contrastive_dim,
        "Le": config.num_encoder_layers, "Ld": config.num_decoder_layers,
    }


def _attention(flax: str, torch: str, stack: str) -> list[Rule]:
    proj = {"q_proj": ("D", "D"), "k_proj": ("D", "KH"), "v_proj": ("D", "KH"), "out_proj": ("D", "D")}
    rules = [Rule(f"{flax}/{p}/kernel", f"{torch}.{p}.weight", s, True, stack) for p, s in proj.items()]
    rules += [Rule(f"{flax}/{n}/scale", f"{torch}.{n}.scale", ("h",), False, stack) for n in ("q_norm", "k_norm")]
    return rules


def _ffn(flax: str, torch: str, stack: str) -> list[Rule]:
    proj = {"gate_proj": ("D", "F"), "up_proj": ("D", "F"), "down_proj": ("F", "D")}
    return [Rule(f"{flax}/{p}/kernel", f"{torch}.{p}.weight", s, True, stack) for p, s in proj.items()]


def rules(config: TransformerConfig) -> list[Rule]:
    """The whole table for one config (FFN rules only when the model has an FFN)."""
    E, Dd = "encoder.layers.{i}", "decoder.layers.{i}"
    table = [Rule("embedding/embedding", "embedding.weight", ("V", "D"))]
    table += [
        Rule(f"{ENCODER}/ZCRMSNorm_0/scale", f"{E}.attn_norm.scale", ("D",), stack="Le"),
        Rule(f"{ENCODER}/attn_gate", f"{E}.attn_gate", (), stack="Le"),
        *_attention(f"{ENCODER}/self_attn", f"{E}.self_attn", "Le"),
    ]
    if not config.no_feedforward:
        table += [
            Rule(f"{ENCODER}/ZCRMSNorm_1/scale", f"{E}.ffn_norm.scale", ("D",), stack="Le"),
            Rule(f"{ENCODER}/ffn_gate", f"{E}.ffn_gate", (), stack="Le"),
            *_ffn(f"{ENCODER}/FeedForward_0", f"{E}.ffn", "Le"),
        ]
    table.append(Rule("encoder/final_norm/scale", "encoder.final_norm.scale", ("D",)))
    table += [
        Rule(f"{DECODER}/ZCRMSNorm_0/scale", f"{Dd}.self_attn_norm.scale", ("D",), stack="Ld"),
        Rule(f"{DECODER}/self_attn_gate", f"{Dd}.self_attn_gate", (), stack="Ld"),
        *_attention(f"{DECODER}/self_attn", f"{Dd}.self_attn", "Ld"),
        Rule(f"{DECODER}/ZCRMSNorm_1/scale", f"{Dd}.cross_attn_norm.scale", ("D",), stack="Ld"),
        Rule(f"{DECODER}/cross_attn_gate", f"{Dd}.cross_attn_gate", (), stack="Ld"),
        *_attention(f"{DECODER}/cross_attn", f"{Dd}.cross_attn", "Ld"),
    ]
    if not config.no_feedforward:
        table += [
            Rule(f"{DECODER}/ZCRMSNorm_2/scale", f"{Dd}.ffn_norm.scale", ("D",), stack="Ld"),
            Rule(f"{DECODER}/ffn_gate", f"{Dd}.ffn_gate", (), stack="Ld"),
            *_ffn(f"{DECODER}/FeedForward_0", f"{Dd}.ffn", "Ld"),
        ]
    table += [
        Rule("decoder/ZCRMSNorm_0/scale", "decoder.final_norm.scale", ("D",)),
        Rule("contrastive_hidden/kernel", "contrastive_hidden.weight", ("D", "D4"), True),
        Rule("contrastive_hidden/bias", "contrastive_hidden.bias", ("D4",)),
        Rule("contrastive_proj/kernel", "contrastive_proj.weight", ("D4", "C"), True),
        Rule("log_temp", "log_temp", ()),
    ]
    return table


def config_hint(names: set[str], config: TransformerConfig) -> str | None:
    """A checkpoint with (without) FFN weights under a config without (with) them names that field."""
    has_ffn = any(("FeedForward" in name or ".ffn." in name) for name in names)
    if has_ffn and config.no_feedforward:
        return "The checkpoint has feed-forward weights but config.no_feedforward=True; fix the config"
    if not has_ffn and not config.no_feedforward:
        return "The checkpoint has no feed-forward weights but config.no_feedforward=False; fix the config"
    return None
