# noengram: made by upstream's own code through tools/upstream_goldens.py
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
seed: 11  depth: 2  layers kept at that depth: [0, 3]
saved config: {"d_model": 64, "embedding_dim": 32, "embedding_queries": 2, "engram_layers": [], "engram_slots": 61, "flash": true, "global_layers": [], "ladder_depths": [], "ladder_order": [], "ladder_widths": [], "max_seq_len": 64, "mhc_lanes": 2, "num_heads": 4, "num_kv_heads": 2, "num_layers": 4, "qk_head_dim": 16, "qkv_conv_taps": 2, "sliding_window": 0, "v_head_dim": 8, "vocab_size": 96}
covers:
  - no engram sites
  - flash path with qk_head_dim 16 > v_head_dim 8 (v padded)
  - GQA 4 query heads / 2 kv heads
  - qkv conv with 2 taps
  - no sliding window, no global layers
  - mHC with 2 lanes
  - width child: A.width_config(cfg, 32) + A.width_slice (width_logits)
  - depth-2 exit/subnetwork/ladder (layers 0, 3)
