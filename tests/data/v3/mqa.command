# mqa: made by upstream's own code through tools/upstream_goldens.py
command: tools/upstream_goldens.sh --only noengram mqa
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
seed: 12  depth: 3  layers kept at that depth: [0, 1, 3]
saved config: {"d_model": 48, "embedding_dim": 32, "engram_layers": [0, 2], "engram_seed_heads": 3, "engram_slots": 97, "global_layers": [], "ladder_depths": [], "ladder_order": [], "ladder_widths": [], "max_seq_len": 64, "mhc_lanes": 3, "num_heads": 4, "num_kv_heads": 1, "num_layers": 4, "out_vocab": 200, "qk_head_dim": 8, "qkv_conv_taps": 0, "sliding_window": 6, "v_head_dim": 16, "vocab_size": 300}
covers:
  - MQA: 1 kv head
  - d_model 48, not a power of two (Hadamard pads to 64)
  - qk_head_dim 8 < v_head_dim 16 (flash pads q/k)
  - out_vocab 200 < vocab 300 (logits over the first 200 rows; ids >= 200 in the inputs)
  - engram sites (0, 2) with engram_seed_heads 3
  - no qkv conv (taps 0)
  - sliding window 6 on every layer, no global layers
  - mHC with 3 lanes
  - embedding_dim 32
  - depth-3 rung drops engram site 1 (layer 2)
  - greedy prompt longer than the window
