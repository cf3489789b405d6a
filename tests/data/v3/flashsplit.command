# flashsplit: made by upstream's own code through tools/upstream_goldens.py
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
seed: 14  depth: 2  layers kept at that depth: [0, 4]
saved config: {"d_model": 64, "engram_heads": 2, "engram_layers": [1, 3], "engram_slots": 61, "flash": true, "global_layers": [2], "ladder_depths": [], "ladder_order": [], "ladder_widths": [], "max_seq_len": 64, "mhc_lanes": 4, "num_heads": 4, "num_kv_heads": 2, "num_layers": 5, "qk_head_dim": 8, "qkv_conv_taps": 3, "sliding_window": 4, "v_head_dim": 24, "vocab_size": 128}
covers:
  - flash path with qk_head_dim 8 < v_head_dim 24
  - explicit engram_heads 2 (4 tables of sub_dim 16), sites (1, 3)
  - sliding window 4 with global layer 2
  - qkv conv with 3 taps
  - mHC with 4 lanes
  - default heads (embedding_dim 128, 4 probes, 4 queries)
  - LoRA adapter rank 4 scale 2.0 (lora_logits)
  - depth-2 rung keeps layers (0, 4): drops both engram sites and the only global layer
  - rung checkpoint flashsplit.rung2.safetensors
