# needle-v3-tiny.text: made by upstream's own code through tools/upstream_goldens.py text_goldens()
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
inputs: needle-v3-tiny.safetensors via R.load_checkpoint, config dtype float32 and params cast to float32; TK.SANTokenizer(needle-v3-tiny.spm.model)
texts: 6 strings (plain, non-ASCII, empty, spaces and newlines) and the prompt half of F.render_example (a query with one tool)
ids: [BOS] + tok.encode(text), right-padded with PAD to the longest (tokens, lengths)
f32/{embedding,confidence,router}: m.apply(..., tokens, method='forward_<head>') on the batch; *_alone: each row alone, unpadded
check: batch vs alone max |diff| 1.49e-07
