"""Upstream's Needle 3 generation loop timed in upstream's own package (run by benchmarks/bench_generate_v3.py).

Runs in the pinned upstream virtualenv (`tools/upstream_goldens.sh` builds it), never in ours: it imports upstream's
`needle` and nothing of this repository. Batch 1 is `needle.model.run.generate` itself (its jitted forward per buffer
length, re-run on the whole PAD-filled buffer for every token; `stream=False`, a tokenizer stand-in that hands over
the prompt's ids). Upstream has no batched loop: at batch > 1 the same loop body (`run._get_decode_fn` on a (B, M)
buffer, argmax at the current position) runs for --steps steps; every step re-runs the same full forward, so those
steps time the loop's per-token rate. Weights: every leaf N(0, 0.02) from numpy seed 0 on upstream's own param
shapes (speed does not depend on the values). Prints one line `RESULT {json}`.

Usage (the benchmark passes these): .upstream-venv/bin/python benchmarks/upstream_generate_v3.py --dtype float32
       --batch 1 --prompt-len 256 --new-tokens 64 [--steps N] [--repeats 1] [--config JSON of fields]
"""

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import needle.model.architecture as A
import needle.model.run as R
import numpy as np

BOS, FIRST_PLAIN_ID = 2, 20  # ids below 20 are PAD, EOS, BOS, UNK and the chat markers


class _Ids:
    """run.generate's tokenizer, for a prompt given as ids: encode drops the BOS it adds back; decode gives one
    character a token, so the returned text's length counts the tokens made (the loop stops at EOS)."""

    def encode(self, ids):
        return list(ids[1:])

    def decode(self, ids):
        return "x" * len(ids)


def random_params(model, config, dtype: str):
    """Upstream's param tree shapes (jax.eval_shape of init), every leaf N(0, 0.02), cast as the goldens cast."""
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    rng = np.random.default_rng(0)
    leaves, tree = jax.tree.flatten(shapes)
    made = [jnp.asarray((rng.standard_normal(s.shape, dtype=np.float32) * 0.02).astype(jnp.dtype(dtype)))
            for s in leaves]
    return jax.tree.unflatten(tree, made)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=0, help="batch > 1: steps timed (0: all)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--config", default="{}", help="TransformerConfig fields as JSON (default: upstream's)")
    args = parser.parse_args()

    config = A.TransformerConfig(**{**json.loads(args.config), "dtype": args.dtype})
    model = A.SimpleAttentionNetwork(config)
    params = random_params(model, config, args.dtype)
    B, P, G = args.batch, args.prompt_len, args.new_tokens
    rng = np.random.default_rng(1)
    prompts = rng.integers(FIRST_PLAIN_ID, config.vocab_size, (B, P)).astype(np.int32)
    prompts[:, 0] = BOS
    M = min(config.max_seq_len, P + G)

    if B == 1:
        tokenizer = _Ids()

        def request():
            return len(R.generate(model, params, tokenizer, prompts[0].tolist(), max_new_tokens=G, stream=False))
    else:
        steps = args.steps or G

        def request():
            decode_fn = R._get_decode_fn(model, M)  # run.generate's own jitted forward for this buffer length
            buffer = jnp.full((B, M), 0, jnp.int32).at[:, :P].set(jnp.asarray(prompts))
            for pos in range(P - 1, P - 1 + steps):
                nxt = jnp.argmax(decode_fn(params, buffer)[:, pos], axis=-1).astype(jnp.int32)  # (B,)
                np.asarray(nxt)  # the host sees each step's tokens, as run.generate's int() does
                buffer = buffer.at[:, pos + 1].set(nxt)
            return steps

    first, made = timed(request)
    warm = min(timed(request)[0] for _ in range(args.repeats))
    # the prefill: one call of the same forward on the prompt's buffer (the loop's first step chooses token 0)
    decode_fn = R._get_decode_fn(model, M)
    buffer = jnp.full((B, M), 0, jnp.int32).at[:, :P].set(jnp.asarray(prompts))
    prefill = min(timed(lambda: decode_fn(params, buffer).block_until_ready())[0] for _ in range(max(2, args.repeats)))
    print("RESULT " + json.dumps({"first_call_s": first, "e2e_s": warm, "steps": made, "batch": B,
                                  "prefill_s": prefill, "jax": jax.__version__,
                                  "threads": os.environ.get("OMP_NUM_THREADS", "")}), flush=True)


if __name__ == "__main__":
    main()
