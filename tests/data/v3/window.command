# window: made by upstream's own code through tools/upstream_goldens.py
command: tools/upstream_goldens.sh --only window flashsplit
regenerate: tools/upstream_goldens.sh   (from the repo root)
cactus-needle: 3.2.8
jax: 0.10.2
jaxlib: 0.10.2
flax: 0.12.8
numpy: 2.4.6
safetensors: 0.8.0
ml_dtypes: 0.7.0
python: 3.11.7
matmul precision: jax_default_matmul_precision=highest, JAX_PLATFORMS=cpu
seed: 13  depth: 3  layers kept at that depth: [0, 1, 4]
saved config: {"confidence_probes": 2, "d_model": 96, "embedding_dim": 32, "engram_layers": [2], "engram_slots": 61, "flash": false, "global_layers": [1, 4], "ladder_depths": [], "ladder_order": [0, 4, 1, 3, 2], "ladder_widths": [], "max_seq_len": 64, "mhc_lanes": 2, "num_heads": 6, "num_kv_heads": 3, "num_layers": 5, "qk_head_dim": 12, "qkv_conv_taps": 3, "sliding_window": 5, "v_head_dim": 12, "vocab_size": 96}
covers:
  - non-flash attention path (flash=False)
  - d_model 96, not a power of two (Hadamard pads to 128)
  - equal head dims 12/12, 6 heads / 3 kv heads
  - qkv conv with 3 taps
  - sliding window 5 with global layers (1, 4)
  - one engram site (layer 2)
  - custom ladder_order (0, 4, 1, 3, 2): depth 3 keeps layers (0, 1, 4), drops the engram site, global layers remap to (1, 2)
  - mHC with 2 lanes
  - embedding_dim 32, 2 confidence probes
  - rung checkpoint window.rung3.safetensors
