"""The Needle 2 family declaration: what shared code knows of it."""

from __future__ import annotations

from convert.family import CliOption, Family
from convert.v2 import mapping
from convert.v2.config import NEEDLE_V2_PUBLISHED, TransformerConfig

FAMILY = Family(
    name="v2",
    title="Needle 2 (decoder-only)",
    config_cls=TransformerConfig,
    rules=mapping.rules,
    dims=mapping.dims,
    stack_names=mapping.STACKS,
    symbols=mapping.SYMBOLS,
    published=NEEDLE_V2_PUBLISHED,
    docs_config=TransformerConfig(d_model=64, num_heads=4, num_kv_heads=2, num_layers=3, engram_layers=(1,),
                                  vocab_size=512, engram_slots=64),
    groups=mapping.GROUPS,
    default_groups=mapping.DEFAULT_GROUPS,
    pickle_version=2,
    pickle_keys=("format_version", "params", "config", "step", "run"),
    parity_options=(CliOption("seq_len", int, "sequence length of the random batch", default=64),),
    commands={"quant": "parity_tests.v2.quant:quant"},
    generate_options=(
        CliOption("system", str, "a system turn before the user turn, as upstream renders it"),
        CliOption("kv_window", int, "attention sees the last W positions (plus sinks); 0 = all, as upstream's "
                                    "generate_cached defaults", default=0, min=0),
        CliOption("sink_tools", bool, "with --kv-window: keep the prompt up to </tools> visible as sinks "
                                      "(upstream's generate_cached pins none)", default=False),
        CliOption("temperature", float, "0 = greedy (upstream's default); above 0, sample from softmax(logits / T)",
                  default=0.0, min=0.0),
        CliOption("seed", int, "the sampling seed (with --temperature)"),
    ),
)
