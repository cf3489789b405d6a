"""Greedy generation speed of both twins at the published Needle v1 size, beside upstream's recompute loop.

In one run, side by side, for each compute dtype and batch size (random weights, 256 encoder
tokens, 64 new tokens; ids 0..5 suppressed so every row runs all 64 steps, as random weights
would otherwise stop at a random EOS):
  upstream recompute loop   Flax jit, the whole 65-token buffer re-decoded every step (the reference)
  flax cached               one jitted while_loop over decode_step (needle_flax.generate)
  torch cached eager        needle_torch.generate
  torch cached compiled     the same with compile=True (torch.compile; at batch <= 4 the step's products are
                            fused reductions; its compile time reported apart)
  encode latency            torch eager vs Flax jit on the same 256 tokens
  bandwidth bound           bytes a decoder step must read (weights; weights + K/V caches) against a
                            copy bandwidth measured in the same run
Tokens/s are end to end (encode + 64 steps), best of --repeats, the methods interleaved so a change
in machine load hits them alike. Targets (issue 5): torch cached >= 15x the recompute loop, Flax
cached >= 5x, torch encode no slower than Flax jit.

Usage: python benchmarks/bench_generate.py [--dtype bfloat16 float32] [--batch 1 32] [--repeats 3]
       [--recompute-repeats 1] [--threads N] [--no-compile] [--new-tokens 64] [--src-len 256]
The recompute loop at batch 32 takes ~1.5 s per step on 2 cores (~100 s a run): it is timed
--recompute-repeats times at batch > 1. Run on an otherwise idle machine; the load is printed.
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
from convert.trees import np_dtype  # noqa: E402
from convert.v1.config import FIRST_PLAIN_ID, NEEDLE_V1_PUBLISHED, SPECIAL_IDS, TransformerConfig  # noqa: E402

SUPPRESS = SPECIAL_IDS  # PAD EOS BOS UNK <tool_call> <tools>: no early stop on random weights


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(threads: int) -> tuple[float, str]:
    """Bytes/s (read + write) of a 256 MiB copy into a preallocated buffer, best of numpy (1 thread) and torch."""
    from benchmarks.bandwidth import copy_bandwidth as torch_copy_bandwidth  # torch only when measured
    from benchmarks.bandwidth import numpy_copy_bandwidth

    numpy_bw, torch_bw = numpy_copy_bandwidth(), torch_copy_bandwidth()
    return max(numpy_bw, torch_bw), f"numpy copy {numpy_bw / 1e9:.1f} GB/s, torch copy ({threads} threads) " \
                                    f"{torch_bw / 1e9:.1f} GB/s"


def step_bytes(cfg: TransformerConfig, batch: int, src_len: int, new_tokens: int) -> tuple[int, int]:
    """(decoder weight bytes, + K/V cache bytes) one greedy step must read, weights in their stored dtype.

    Weights: per decoder layer the self-attention q/k/v/out and cross-attention q/out projections (cross
    k/v were projected once per request), norms and gates; the final norm; the tied embedding for the
    logits. Caches: float32 self-attention K/V over the mean attended length; cross K in the compute
    dtype and cross V in float32 (as DecoderCache keeps them) over the source.
    """
    item = np_dtype(cfg.dtype).itemsize
    D, KH, h = cfg.d_model, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    per_layer = (2 * D * D + 2 * D * KH) + 2 * D * D + 2 * D + 4 * h + 2  # self q/k/v/out, cross q/out, norms
    if not cfg.no_feedforward:
        per_layer += 3 * D * cfg.d_ff + D + 1
    weights = (cfg.num_decoder_layers * per_layer + D + cfg.vocab_size * D) * item
    mean_len = (new_tokens + 1) / 2
    self_kv = cfg.num_decoder_layers * 2 * batch * KH * mean_len * 4
    cross_kv = cfg.num_decoder_layers * batch * KH * src_len * (item + 4)
    return weights, int(weights + self_kv + cross_kv)


def bench_case(dtype: str, batch: int, args, bandwidth: float) -> list[str]:
    import jax
    import jax.numpy as jnp
    import torch

    from needle_flax.v1.generate import _decode_full, encode, generate, generate_recompute
    from needle_flax.v1.model import SimpleAttentionNetwork as FlaxModel
    from needle_torch.v1.generate import generate as torch_generate
    from needle_torch.v1.model import SimpleAttentionNetwork as TorchModel

    cfg = NEEDLE_V1_PUBLISHED.replace(dtype=dtype)
    tree = random_flax_params(cfg, seed=0, dtype=dtype)
    flax_model, params = FlaxModel(cfg), jax.tree.map(jnp.asarray, tree)
    torch_model = TorchModel.from_flax(tree, cfg, dtype=dtype)
    src_np = np.random.default_rng(1).integers(FIRST_PLAIN_ID, cfg.vocab_size, (batch, args.src_len)).astype(np.int32)
    src_j, src_t = jnp.asarray(src_np), torch.from_numpy(src_np).long()
    L = args.new_tokens
    kw = dict(max_new_tokens=L, suppress_tokens=SUPPRESS)

    runs = {
        "flax cached (jit)": lambda: generate(flax_model, params, src_j, None, **kw).block_until_ready(),
        "torch cached eager": lambda: torch_generate(torch_model, src_t, None, **kw),
    }
    compile_note = ""
    if args.compile:
        runs["torch cached compiled"] = lambda: torch_generate(torch_model, src_t, None, **kw, compile=True)
    recompute = lambda: generate_recompute(flax_model, params, src_j, None, **kw).block_until_ready()  # noqa: E731

    # Warm up: every compilation happens here, none inside a timed run.
    start = time.perf_counter()
    runs["flax cached (jit)"]()
    flax_compile = time.perf_counter() - start
    runs["torch cached eager"]()
    if args.compile:
        start = time.perf_counter()
        runs["torch cached compiled"]()
        compile_note = f"torch.compile first call {time.perf_counter() - start:.1f}s"
    encoder_out = encode(params, src_j, None, model=flax_model).block_until_ready()
    _decode_full(params, jnp.ones((batch, L + 1), jnp.int32), encoder_out, None, model=flax_model).block_until_ready()

    def encode_torch():
        with torch.inference_mode():
            torch_model.encode(src_t)

    encodes = {
        "torch": encode_torch,
        "flax": lambda: encode(params, src_j, None, model=flax_model).block_until_ready(),
    }
    times = {name: [] for name in [*runs, "upstream recompute loop", *encodes]}
    rec_repeats = args.repeats if batch == 1 else args.recompute_repeats
    for rep in range(max(args.repeats, rec_repeats)):
        if rep < rec_repeats:
            times["upstream recompute loop"].append(best_of(recompute, 1))
        if rep < args.repeats:
            for name, fn in {**runs, **encodes}.items():
                times[name].append(best_of(fn, 1))
    best = {name: min(t) for name, t in times.items()}
    enc_torch, enc_flax = best["torch"], best["flax"]

    weights, with_kv = step_bytes(cfg, batch, args.src_len, L)
    tokens = batch * L
    rec = tokens / best["upstream recompute loop"]
    lines = [f"\n{dtype}, batch {batch}: {args.src_len} encoder tokens, {L} new tokens per row "
             f"(Flax first call incl. compile {flax_compile:.1f}s{'; ' + compile_note if compile_note else ''})",
             f"  {'method':<26}{'tokens/s':>10}{'x recompute':>13}{'ms/step*':>10}{'GB/s read*':>12}{'of bw':>7}"]
    for name in ["upstream recompute loop", *runs]:
        t = best[name]
        step_s = (t - (enc_torch if name.startswith("torch") else enc_flax)) / L
        cached = name != "upstream recompute loop"
        # decode-only figures need the encode time, measured apart: a load spike can make them meaningless
        per_step = f"{1e3 * step_s:>10.2f}" if step_s > 0 else f"{'n/a':>10}"
        read = f"{with_kv / step_s / 1e9:>12.2f}{with_kv / step_s / bandwidth:>7.0%}" if cached and step_s > 0 \
            else f"{'-':>12}{'-':>7}"
        lines.append(f"  {name:<26}{tokens / t:>10.1f}{tokens / t / rec:>12.1f}x{per_step}{read}")
    lines.append(f"  encode latency: torch eager {1e3 * enc_torch:.1f} ms, flax jit {1e3 * enc_flax:.1f} ms "
                 f"(torch/flax {enc_torch / enc_flax:.2f}; target <= 1)")
    bound_w, bound_kv = batch * bandwidth / weights, batch * bandwidth / with_kv
    lines.append(f"  bandwidth bound: a step reads {weights / 1e6:.1f} MB of decoder weights "
                 f"({with_kv / 1e6:.1f} MB with K/V caches) -> at most {bound_w:.0f} tokens/s "
                 f"({bound_kv:.0f} with caches) at {bandwidth / 1e9:.1f} GB/s")
    torch_best = max((n for n in runs if n.startswith("torch")), key=lambda n: tokens / best[n])
    lines.append(f"  targets: torch cached {tokens / best[torch_best] / rec:.1f}x (>= 15x: "
                 f"{'met' if tokens / best[torch_best] / rec >= 15 else 'MISSED'}, {torch_best}); "
                 f"flax cached {tokens / best['flax cached (jit)'] / rec:.1f}x (>= 5x: "
                 f"{'met' if tokens / best['flax cached (jit)'] / rec >= 5 else 'MISSED'}); torch encode "
                 f"{'met' if enc_torch <= enc_flax else 'MISSED'}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--recompute-repeats", type=int, default=1, help="timed recompute runs at batch > 1")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--src-len", type=int, default=256)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    args = parser.parse_args()

    import jax
    import torch

    torch.set_num_threads(args.threads)
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__} ({args.threads} threads), jax {jax.__version__} "
          f"({jax.devices()[0].platform}); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if load[0] > 0.5:
        print("  note: other processes are using the CPUs; every figure below is pessimistic and noisy")
    bandwidth, how = copy_bandwidth(args.threads)
    print(f"copy bandwidth (read + write): {how}; using {bandwidth / 1e9:.1f} GB/s")
    print("* ms/step and GB/s read are decode-only (end-to-end time minus that backend's encode latency); "
          "GB/s counts weights + K/V caches")
    for dtype in args.dtype:
        for batch in args.batch:
            for line in bench_case(dtype, batch, args, bandwidth):
                print(line, flush=True)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
