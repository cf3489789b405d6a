# needle-v3-tiny.window: made by upstream's own code through tools/upstream_goldens.py window_goldens()
command: tools/upstream_goldens.sh --text-only
regenerate: tools/upstream_goldens.sh --text-only   (from the repo root)
cactus-needle: 3.2.8
jax: 0.10.2
jaxlib: 0.10.2
flax: 0.12.8
numpy: 2.4.6
safetensors: 0.8.0
ml_dtypes: 0.7.0
python: 3.11.7
matmul precision: jax_default_matmul_precision=highest, JAX_PLATFORMS=cpu
inputs: needle-v3-tiny.safetensors via R.load_checkpoint, float32; prompt: needle-v3-tiny.npz's `prompt` (9 ids)
loop: run.generate's (greedy, the full forward on a PAD-filled buffer of 21), each step m.apply(params, buf, mask=make_causal_mask(M) & (q - k < 5 | sink[k])), sink = the first 3 positions: hidden_cells' window and sink
f32/tokens (1, 12), f32/logits (1, 12, V): the chosen ids and their logits
