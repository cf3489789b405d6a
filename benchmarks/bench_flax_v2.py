"""Needle 2 generation speed in Flax at the published size: upstream's decode.py loop beside our cached loop.

At the published `base` config (D 512, 27 layers; random weights, `random_flax_params(config, seed=0)`),
a 256-token prompt (BOS + random plain ids) and 64 new tokens, for batch 1 and 32:
  upstream loop      tests.v2.upstream_decode, upstream's decode.py ported as it is: `generate_cached` (a Python
                     loop of jitted `forward_cached` steps) at batch 1, `batched_generate` (flash prefill + a
                     lax.scan rollout) at batch > 1. It always runs in float32 (it casts the params), so it is
                     measured once per batch size. Its jit unrolls the 27 layers (and each layer's 20 Sinkhorn
                     iterations) in Python, as upstream's does: the compile takes minutes.
  flax cached        needle_flax.v2.generate: one jit (prefill + lax.while_loop of steps, a lax.scan over the
                     layers), in float32 and in bfloat16 (params cast to the compute dtype).
Reported: tokens/s end to end (prefill + every step, best of --repeats), prefill latency (a jitted prefill
alone), decode-only tokens/s ((tokens - the prefill's) / (end to end - prefill)), and the first call's time,
which is the XLA compile (plus one run). Our loop runs with eos_token_id=None so every row makes all 64
tokens; upstream's batch-1 loop stops at EOS, so its token count is printed. Targets (issue): flax cached >=
2x upstream's loop, compile <= 30 s. The issue's own figures for upstream on this 2-core machine: 12.1 tok/s
at batch 1 (prefill 412 ms) after 257 s of compile; 47.7 tok/s at batch 32 after 412 s.

Usage: python benchmarks/bench_flax_v2.py [--batch 1 32] [--dtype float32 bfloat16] [--repeats 3]
       [--upstream-repeats 1] [--layers 27] [--no-upstream] [--prompt-len 256] [--new-tokens 64]
--layers N runs both at a reduced depth (the same config otherwise), for a quicker look at upstream's compile.
The machine is shared: the load average is printed before and after; rerun when it is high.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from convert.mapping import random_flax_params  # noqa: E402
from convert.v2.config import BOS_ID, FIRST_PLAIN_ID, NEEDLE_V2_PUBLISHED  # noqa: E402


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def best_of(fn, repeats: int) -> float:
    return min(timed(fn)[0] for _ in range(repeats))


def load_line(when: str) -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {when}: {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def upstream_case(config, tree, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    """decode.py's own driver for this batch: generate_cached at batch 1, batched_generate above."""
    import jax
    import jax.numpy as jnp

    from needle_flax.layers import precompute_rope_freqs
    from tests.v2 import upstream_decode as D

    B, P = prompts.shape
    encoded = [row[1:].tolist() for row in prompts]  # upstream prepends BOS itself
    if B == 1:
        run = lambda: D.generate_cached(config, tree, encoded[0], max_new_tokens=new_tokens)  # noqa: E731
    else:
        run = lambda: D.batched_generate(config, tree, encoded, max_new_tokens=new_tokens)[1]  # noqa: E731
    first, out = timed(run)
    made = len(out) if B == 1 else int(np.asarray(out).size)
    total = best_of(run, repeats)

    # Prefill alone, as the driver calls it (batch 1: non-flash at pos 0; batched: flash with key_valid). The
    # batch-1 prefill is the driver's own compiled function (already compiled above); the batched one is a
    # separate jit of the same forward, so it compiles again (timed apart).
    M = P + new_tokens
    p32, dcfg = D._f32(tree), D.decode_cfg(config)
    cos, sin = precompute_rope_freqs(config.head_dim, M, config.rope_theta)
    k_cache, v_cache = D.init_kv_cache(config, B, M)
    hist = jnp.pad(jnp.asarray(prompts), ((0, 0), (0, new_tokens)))
    valid = jnp.ones((B, M), jnp.bool_)
    flash = B > 1
    key_valid, sink = (valid, jnp.zeros((B, M), jnp.bool_)) if flash else (None, None)
    prefill = lambda: jax.block_until_ready(D.forward_cached(  # noqa: E731
        p32, dcfg, jnp.asarray(prompts), k_cache, v_cache, 0, cos, sin, key_valid, flash, hist, valid, sink)[0])
    prefill_compile, _ = timed(prefill)
    return {"first": first, "total": total, "made": made, "prefill": best_of(prefill, repeats),
            "prefill_first": prefill_compile if flash else None}


def flax_case(config, tree, prompts: np.ndarray, new_tokens: int, repeats: int) -> dict:
    import jax
    import jax.numpy as jnp

    from needle_flax.v2 import SimpleAttentionNetwork
    from needle_flax.v2.generate import decode_step, generate, new_cache

    model, params = SimpleAttentionNetwork(config), jax.tree.map(jnp.asarray, tree)
    B, P = prompts.shape
    run = lambda: jax.block_until_ready(generate(model, params, prompts, new_tokens, eos_token_id=None))  # noqa: E731
    first, out = timed(run)
    total = best_of(run, repeats)

    @jax.jit
    def prefill(params, prompts):
        return decode_step(model, params, new_cache(model, B, P + new_tokens), prompts, 0, last_only=True)[0]

    tokens = jnp.asarray(prompts)
    jax.block_until_ready(prefill(params, tokens))
    latency = best_of(lambda: jax.block_until_ready(prefill(params, tokens)), repeats)
    return {"first": first, "total": total, "made": int(out.size), "prefill": latency}


def report(name: str, r: dict, batch: int) -> str:
    decode = (r["made"] - batch) / max(r["total"] - r["prefill"], 1e-9)  # the prefill chose each row's first token
    extra = f"; its batched prefill jit alone compiled in {r['prefill_first']:.1f} s" if r.get("prefill_first") else ""
    return (f"  {name:<24}{r['made'] / r['total']:>10.1f}{decode:>14.1f}{1e3 * r['prefill']:>13.0f}"
            f"{r['first']:>14.1f}{r['made']:>8}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--upstream-repeats", type=int, default=1)
    parser.add_argument("--layers", type=int, default=NEEDLE_V2_PUBLISHED.num_layers)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-upstream", dest="upstream", action="store_false")
    args = parser.parse_args()

    import jax

    print(load_line("at the start"), flush=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; base config"
          f"{'' if args.layers == NEEDLE_V2_PUBLISHED.num_layers else f' reduced to {args.layers} layers'}, "
          f"{args.prompt_len}-token prompts, {args.new_tokens} new tokens", flush=True)
    base = NEEDLE_V2_PUBLISHED.replace(num_layers=args.layers,
                                       engram_layers=tuple(s for s in NEEDLE_V2_PUBLISHED.engram_layers
                                                           if s < args.layers))
    trees = {dtype: random_flax_params(base.replace(dtype=dtype), seed=0, dtype=dtype) for dtype in args.dtype}
    header = (f"  {'method':<24}{'tok/s':>10}{'decode tok/s':>14}{'prefill ms':>13}{'first call s':>14}"
              f"{'tokens':>8}")
    for batch in args.batch:
        rng = np.random.default_rng(1)
        prompts = rng.integers(FIRST_PLAIN_ID, base.vocab_size, (batch, args.prompt_len)).astype(np.int32)
        prompts[:, 0] = BOS_ID
        print(f"\nbatch {batch} ({load_line('now')})\n{header}", flush=True)
        results = {}
        if args.upstream:
            # decode.py casts to float32 whatever it is given: the float32 tree is its input
            tree = trees.get("float32") or random_flax_params(base, seed=0)
            results["upstream"] = upstream_case(base.replace(dtype="float32"), tree, prompts, args.new_tokens,
                                                args.upstream_repeats)
            print(report("upstream loop (f32)", results["upstream"], batch), flush=True)
        for dtype in args.dtype:
            results[dtype] = flax_case(base.replace(dtype=dtype), trees[dtype], prompts, args.new_tokens, args.repeats)
            line = report(f"flax cached ({dtype})", results[dtype], batch)
            if "upstream" in results:
                up = results["upstream"]
                line += (f"   {results[dtype]['made'] / results[dtype]['total'] / (up['made'] / up['total']):.1f}x "
                         "upstream end to end")
            print(line, flush=True)
    print("\n" + load_line("at the end"))
    print("tok/s: end to end (prefill + steps), best of the repeats; decode tok/s: the tokens after the prefill's "
          "over the time after it; first call s: the first call of the whole driver (XLA compile + one run)")


if __name__ == "__main__":
    main()
