"""Needle v1's probe table: every named capture point of the encoder-decoder, in execution order."""

from __future__ import annotations

from convert.v1.config import TransformerConfig
from parity_tests.probes import Probe

ENC_BLOCK = ("encoder", "layers", "EncoderBlock_0")
DEC_BLOCK = ("decoder", "layers", "DecoderBlock_0")


# Per-block probes in execution order, with the name each twin's block sows / taps them under.
_BLOCK_PROBES = {
    "encoder": (ENC_BLOCK, ("self_attn", "self_attn_residual")),
    "decoder": (DEC_BLOCK, ("self_attn", "cross_attn")),
}
_SOWN = {"self_attn": "self_attn_out", "cross_attn": "cross_attn_out", "ffn": "ffn_out",
         "self_attn_residual": "self_attn_residual"}


def _block(stack: str, i: int, has_ffn: bool) -> list[Probe]:
    """The probes of encoder/decoder block i: its sub-layers, then the block output (a stage boundary)."""
    p = f"{stack}.layers.{i}"
    flax_block, names = _BLOCK_PROBES[stack]
    names = (*names, "ffn") if has_ffn else names
    out = [Probe(f"{p}.{n}", (*flax_block, _SOWN[n]), f"{p}.{n}", i) for n in names]
    out.append(Probe(f"{p}.out", (*flax_block, "out"), p, i, boundary=True))
    return out


def probe_table(config: TransformerConfig) -> list[Probe]:
    """Every probe of this config, in execution order."""
    ffn = not config.no_feedforward
    table = [Probe("encoder.embed", ("encoder", "embed"), "encoder.embed", boundary=True)]
    for i in range(config.num_encoder_layers):
        table += _block("encoder", i, ffn)
    table.append(Probe("encoder.out", ("encoder", "out"), "encoder.final_norm", boundary=True))
    table.append(Probe("decoder.embed", ("decoder", "embed"), "decoder.embed", boundary=True))
    for i in range(config.num_decoder_layers):
        table += _block("decoder", i, ffn)
    table.append(Probe("decoder.out", ("decoder", "out"), "decoder.final_norm", boundary=True))
    table.append(Probe("logits", ("logits",), "logits_tap"))
    table.append(Probe("contrastive", ("contrastive",), "contrastive_tap", pass_="contrastive"))
    return table
