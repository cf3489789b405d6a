"""The Needle 3 family declaration: what shared code knows of it."""

from __future__ import annotations

from convert.family import CliOption, Family
from convert.v3 import ladder, mapping
from convert.v3.config import NEEDLE_V3_DEFAULT, TransformerConfig

FAMILY = Family(
    name="v3",
    title="Needle 3 (laddered decoder)",
    config_cls=TransformerConfig,
    rules=mapping.rules,
    dims=mapping.dims,
    stack_names=mapping.STACKS,
    symbols=mapping.SYMBOLS,
    published=NEEDLE_V3_DEFAULT,
    docs_config=TransformerConfig(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, num_layers=3,
                                  qk_head_dim=16, v_head_dim=24, engram_layers=(1,), global_layers=(2,),
                                  sliding_window=8, engram_slots=64),
    parity_options=(CliOption("seq_len", int, "sequence length of the random batch", default=64),),
    groups=mapping.GROUPS,
    default_groups=mapping.DEFAULT_GROUPS,
    pickle_version=2,  # cactus-needle 3.0.0 still wrote pickles for paths not ending in .safetensors
    pickle_keys=("format_version", "params", "config", "step", "run"),
    safetensors_version="2",
    rung=ladder.rung,
    halve=ladder.halve,
    generate_options=(
        CliOption("system", str, "a system turn before the user turn, as upstream renders it"),
        CliOption("context", str, "text for a <context> block in the user turn (not upstream's Python rendering)"),
        CliOption("extract", str, "text for an <extract> block in the user turn (not upstream's Python rendering)"),
        CliOption("schema", str, "a JSON schema, inline or a .json file, for a <schema> block (not upstream's Python "
                                 "rendering)"),
        CliOption("layers", int, "decode on ladder rung d (its first layers by rank, upstream's subnetwork_only)",
                  min=1),
        CliOption("kv_window", int, "global layers see the last W positions (plus sinks); default the model's "
                                    "effective_kv_window (a .cact's header)", min=1),
        CliOption("sink_tools", bool, "with --kv-window: keep the prompt up to </tools> visible as sinks "
                                      "(upstream's generate_cached pins none)", default=False),
        CliOption("temperature", float, "0 = greedy (upstream's default); above 0, sample from softmax(logits / T)",
                  default=0.0, min=0.0),
        CliOption("seed", int, "the sampling seed (with --temperature)"),
    ),
    commands={"generate": "convert.v3.commands:generate", "embed": "convert.v3.commands:embed",
              "quant": "parity_tests.v3.quant:quant"},
    runners={"torch": "needle_torch.v3.runner:Runner", "flax": "needle_flax.v3.runner:Runner"},
)
