# needle-v3-tiny: copied unchanged from the shared fixtures
source: /work/shared/fixtures/needle-v3-tiny.*  (see /work/shared/fixtures/README-v3.md)
copied by: tools/upstream_goldens.py copy_shared_fixture() (the copy step of tools/upstream_goldens.sh)
made by: upstream's own code, cactus-needle 3.2.8 on CPU, jax 0.10.2, flax 0.12.8, numpy 2.4.6, safetensors 0.8.0, sentencepiece 0.2.3,
         jax_default_matmul_precision=highest (README-v3.md describes how)
files: needle-v3-tiny.safetensors, needle-v3-tiny.lora.safetensors, needle-v3-tiny.npz, needle-v3-tiny.cact, needle-v3-tiny.cact.npz, needle-v3-tiny.spm.model
covers: L 5, D 64, H 4, K 2, qk 16 / v 24, taps 3, sliding window 8 with global layers (2, 4), engram sites (1, 3), 4 mHC lanes, vocab 512,
        LoRA rank 4, .cact W4 export with tokenizer, depth-3 exit/ladder; no width_logits (upstream refuses width_config for it)
