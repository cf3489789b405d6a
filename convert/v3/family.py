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
)
