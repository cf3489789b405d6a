"""Cached generation speed of the Needle 2 torch twin at the published size, on both kinds of CPU bf16 path.

At the published `base` size (random weights, convert.mapping.random_flax_params(config, seed=0)), a
256-token prompt and 64 new tokens (EOS never stops a row), for batch 1 and 32, float32 and bfloat16,
torch eager, torch compiled (compile=True: the decoding steps; on CPU at <= cpu_decode.max_rows rows through the
C++ kernels of needle_torch/fast/cpu_decode.py), compiled-all (compile="all": the prefill too) and, on request, traced
(compile=True with those kernels switched off: the torch.compile step, for a side-by-side ratio). Each cell names
the step that ran (kernels, torch.compile or eager):
  tokens/s      new tokens / decode time (the 63 steps after the first token), best of --repeats
  e2e tok/s     every new token / the whole request (prefill included), best of --repeats
  prefill ms    time to the first token: argument checks, cache allocation and the prefill pass
  compile s     first compiled request minus a warm one (compiled-all after compiled in one process: the step's
                graph is already there, so this is the prefill's compile alone)
  % of bound    tokens/s against the memory-bandwidth bound: bytes a step must read (weights in their dtype,
                the tied embedding, the engram projections, the K/V cache over the mean attended length)
                / the copy bandwidth measured in the same process (2 x bytes / time of a 256 MiB copy_ into a
                preallocated, already written buffer: benchmarks/bandwidth.py)
  x upstream    against upstream's own figures on a 2-core AVX2 machine (upstream decodes in float32),
                like for like: decode tok/s against decode tok/s (decode.py's loop 12.1 tok/s at batch 1, the
                batched rollout's steps 69 tok/s at batch 32), end to end against end to end (batch 1: 64 tokens
                after a 412 ms prefill at 12.1 tok/s = 11.4 tok/s; batch 32: the rollout's 47.7 tok/s). Machines
                differ (a 2-core avx512_bf16 EPYC ran upstream's batch-1 loop at 14.5 tok/s, prefill 267 ms): for
                ratios measured side by side, run benchmarks/bench_flax_v2.py first and pass its upstream rows with
                --upstream loop_b1=<decode tok/s> prefill_ms=<prefill ms> (batch 32: steps_b32=, rollout_b32=)
Targets: batch 1 >= 10x the loop in float32 (>= 121 tok/s) and >= 50 % of the bound in bf16; batch 32
>= 5x the rollout; prefill <= 412 ms at batch 1.

Both CPU kinds in one run: every cell set runs in its own process, once on this CPU as it is and once as an
AVX2-only CPU without bf16 units (AVX2_ENV: oneDNN and ATen capped at AVX2, and the compiled graphs and C++ kernels
built as x86-64-v3 code, so with an AVX2 CPU's 16 vector registers), and each bf16 cell set with both bf16 paths
forced (--bf16-paths: a subset; NEEDLE_TWIN_BF16=native: library bf16 kernels, emulated where the CPU has no bf16
units; =upcast: float32 kernels on upcast operands; auto: neither forced, each kind taking the path
needle_torch.fast.kernels.bf16_path() picks there), each process printing the path that ran. --kinds runs one kind only
(--kinds avx2 --bf16-paths auto: the AVX2-only CPU as generation would run there). --f32-paths forces the float32
products of compiled graphs through oneDNN or the library (MKL), one process each, beside the path
needle_torch.fast.kernels.f32_path() picks by the CPU's vendor. --v1 adds Needle v1's torch cells from
benchmarks/bench_generate.py (bf16 encode latency, compiled batch-1 decode end to end) on the same grid. Each
process prints the CPU features it found and the paths that ran.

Usage: python benchmarks/bench_torch_v2.py [--dtype float32 bfloat16] [--batch 1 32] [--repeats 2] [--threads N]
       [--modes eager compiled compiled-all traced] [--bf16-paths native upcast auto] [--f32-paths onednn library]
       [--kinds this avx2] [--no-emulate] [--v1] [--new-tokens 64]
       [--prompt-len 256] [--upstream loop_b1=14.5 prefill_ms=267 ...]
Run on an otherwise idle machine: the load average is printed before and after every process (2 shared cores:
a busy neighbour makes multi-threaded figures meaningless).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bandwidth import copy_bandwidth  # noqa: E402
from convert.mapping import random_flax_params  # noqa: E402
from convert.v1.config import NEEDLE_V1_PUBLISHED, SPECIAL_IDS  # noqa: E402
from convert.v2 import NEEDLE_V2_PUBLISHED  # noqa: E402
from convert.v2.config import BOS_ID, FIRST_PLAIN_ID  # noqa: E402
from needle_torch.fast import cpu_decode  # noqa: E402
from needle_torch.fast.kernels import (  # noqa: E402
    BF16_PATH_ENV,
    F32_PATH_ENV,
    bf16_path,
    cpu_flags,
    cpuinfo,
    decide_bf16_path,
    f32_path,
)
from needle_torch.v1.generate import generate as generate_v1  # noqa: E402
from needle_torch.v1.model import SimpleAttentionNetwork as ModelV1  # noqa: E402
from needle_torch.v2 import SimpleAttentionNetwork  # noqa: E402

# Issue 14's figures for upstream: decode tok/s of the batch-1 loop, its prefill ms, the batch-32 rollout's steps-only
# and end-to-end tok/s.
UPSTREAM = {"loop_b1": 12.1, "prefill_ms": 412.0, "steps_b32": 69.0, "rollout_b32": 47.7}
# generate's (compile, fast) arguments per mode; plain-*: every form of needle_torch.fast off (the baseline)
MODES = {"eager": (False, True), "compiled": (True, True), "compiled-all": ("all", True), "traced": (True, True),
         "plain-eager": (False, False), "plain-compiled": (True, False), "plain-compiled-all": ("all", False)}
DEFAULT_MODES = ["eager", "compiled", "compiled-all", "plain-compiled", "plain-compiled-all"]
# An AVX2-only CPU's code on this one. Without TORCHINDUCTOR_CPP_MARCH inductor builds with -march=native, and on an
# AVX-512 CPU its 8-float AVX2 vectors still get EVEX encodings and 32 registers (the prefill attention kernel's code
# used ymm16-31 in 105 instructions), which a real AVX2 CPU does not have.
AVX2_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3"}


# Process-wide settings that move these figures without changing the code: OpenMP's wait policy (measured on a 2-core
# Xeon, published size, f32 batch-1 compiled step: PASSIVE 25-26 ms, unset 14-16 ms, ACTIVE 13-15 ms, processes
# alternating), the allocator (docs/PERFORMANCE.md, "Batched prefill runs in row chunks") and the thread count. The
# header names those in effect, so that a table says what it ran under; children inherit them.
RUNTIME_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "GLIBC_TUNABLES", "LD_PRELOAD")


def runtime_settings(environ) -> str:
    """The RUNTIME_ENV variables set in `environ` as 'KEY=VALUE ...', or 'none set'."""
    found = [f"{key}={environ[key]}" for key in RUNTIME_ENV if environ.get(key)]
    return " ".join(found) if found else "none set"


def upstream_overrides(pairs: list[str]) -> dict[str, float]:
    """The KEY=VALUE pairs of --upstream as {key: value}: keys of UPSTREAM, values positive finite numbers."""
    out = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if key not in UPSTREAM or not (math.isfinite(number) and number > 0):
            raise SystemExit(f"--upstream {pair!r}: give KEY=NUMBER (a positive number) with KEY one of "
                             f"{', '.join(UPSTREAM)}")
        out[key] = number
    return out


def upstream_rates(batch: int, new: int) -> tuple[float, float]:
    """(decode tok/s, end-to-end tok/s) of upstream at this batch size, from UPSTREAM (the issue's figures, or
    --upstream's)."""
    if batch == 1:
        return UPSTREAM["loop_b1"], new / (UPSTREAM["prefill_ms"] / 1e3 + (new - 1) / UPSTREAM["loop_b1"])
    return UPSTREAM["steps_b32"], UPSTREAM["rollout_b32"]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def step_bytes(cfg, batch: int, prompt: int, new: int, item: int) -> int:
    """Bytes one decode step must read: every layer's projections, routing, norms and diagonals, both engram
    sites' projections and the tied embedding in the weights' dtype, and the K/V cache (the compute dtype) over
    the mean attended length. The Walsh matrix (one P x P constant, cache-resident) is left out."""
    D, A, KH, n, P = cfg.d_model, cfg.attn_dim, cfg.kv_dim, cfg.mhc_lanes, cfg.hada_dim
    per_layer = 2 * D * A + 2 * D * KH + A * D + n * D * (2 * n + n * n) + 3 * P + 3 * D + 2 * cfg.head_dim
    engram = cfg.num_sites * 2 * cfg.num_engram_tables * cfg.engram_sub_dim * D
    weights = (cfg.num_layers * per_layer + engram + cfg.vocab_size * D + D) * item
    mean_len = prompt + (new - 1) / 2
    kv = cfg.num_layers * 2 * batch * KH * mean_len * item
    return int(weights + kv)


# ----------------------------------------------------------------------------- one process: the cells of one setting


def run_v2(dtype: str, batch: int, mode: tuple[bool | str, bool], args) -> dict:
    compile, fast = mode
    cfg = NEEDLE_V2_PUBLISHED
    model = SimpleAttentionNetwork.from_flax(random_flax_params(cfg, seed=0, groups=()), cfg, dtype=dtype)
    rng = np.random.default_rng(1)
    prompts = rng.integers(FIRST_PLAIN_ID, cfg.vocab_size, (batch, args.prompt_len))
    prompts[:, 0] = BOS_ID
    prompts = torch.from_numpy(prompts)
    G = args.new_tokens

    def request() -> tuple[float, float]:
        """(prefill s = time to the first token, decode s for the G - 1 steps after it)."""
        stamps = []
        start = time.perf_counter()
        model.generate(prompts, G, eos_token_id=None, compile=compile, fast=fast,
                       streamer=lambda _: stamps.append(time.perf_counter()))
        return stamps[0] - start, stamps[-1] - stamps[0]

    first = _timed(request)
    runs = [request() for _ in range(args.repeats)]
    warm = min(p + d for p, d in runs)
    prefill, decode = min(p for p, _ in runs), min(d for _, d in runs)
    item = torch.finfo(model.dtype).bits // 8
    step = ("eager" if compile is False else "kernels" if fast and cpu_decode.applies(model, batch)
            else "torch.compile" if fast else "plain torch.compile")
    return {"step": step, "tok_s": batch * (G - 1) / decode, "e2e_tok_s": batch * G / warm, "prefill_ms": 1e3 * prefill,
            "compile_s": first - warm if compile is not False else None,
            "bytes": step_bytes(cfg, batch, args.prompt_len, G, item)}


def run_v1(args) -> dict:
    """Needle v1's torch cells of benchmarks/bench_generate.py: bf16 encode latency, compiled batch-1 decode."""
    cfg = NEEDLE_V1_PUBLISHED.replace(dtype="bfloat16")
    model = ModelV1.from_flax(random_flax_params(cfg, seed=0, dtype="bfloat16"), cfg, dtype="bfloat16")
    src = torch.from_numpy(np.random.default_rng(1).integers(FIRST_PLAIN_ID, cfg.vocab_size, (1, 256)))

    def encode():
        with torch.inference_mode():
            model.encode(src)

    def decode():
        generate_v1(model, src, None, 64, suppress_tokens=SPECIAL_IDS, compile=True)

    encode()
    first = _timed(decode)
    enc = min(_timed(encode) for _ in range(5))
    dec = min(_timed(decode) for _ in range(args.repeats))
    return {"encode_ms": 1e3 * enc, "decode_tok_s": 64 / dec, "compile_s": first - dec}


def child(args) -> None:
    torch.set_num_threads(args.threads)
    limits = (cpu_decode.MAX_ROWS, cpu_decode.BF16_MAX_ROWS)
    if args.max_rows is not None:
        limits = (args.max_rows, args.max_rows)
    path = bf16_path()
    auto = decide_bf16_path({k: v for k, v in os.environ.items() if k != BF16_PATH_ENV}, cpu_flags(),
                            torch.backends.cpu.get_cpu_capability())
    out = {"load_before": os.getloadavg(), "path": path.name, "reason": path.reason, "auto": str(auto),
           "features": list(path.features), "capability": torch.backends.cpu.get_cpu_capability(),
           "f32": str(f32_path()), "bandwidth": copy_bandwidth(), "cells": {}}
    for spec in args.cells.split(";"):
        if spec == "v1":
            out["cells"][spec] = run_v1(args)
            continue
        dtype, batch, mode = spec.split(",")
        cpu_decode.MAX_ROWS, cpu_decode.BF16_MAX_ROWS = (0, 0) if mode == "traced" else limits
        out["cells"][spec] = run_v2(dtype, int(batch), MODES[mode], args)
    out["load_after"] = os.getloadavg()
    print("RESULT " + json.dumps(out), flush=True)


# ----------------------------------------------------------------------------- the parent: the grid and the table


def spawn(cells: list[str], env: dict, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--cells", ";".join(cells), "--threads", str(args.threads),
           "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len)]
    cmd += [] if args.max_rows is None else ["--max-rows", str(args.max_rows)]
    # A fresh inductor cache per process: compile times are cold ones, and a graph compiled for this CPU's
    # AVX-512 is never reused by an AVX2-only run (torch's cache key leaves ATEN_CPU_CAPABILITY out: the reused
    # code runs 16-lane loops over 8-lane vectors and fails its index checks).
    with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
        proc = subprocess.run(cmd, env={**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": cache}, capture_output=True,
                              text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"a benchmark process failed ({env}):\n{proc.stderr[-3000:]}")


def report(kind: str, res: dict, new: int) -> list[str]:
    bw = res["bandwidth"]
    bf16 = any(spec.startswith("bfloat16") or spec == "v1" for spec in res["cells"])
    path = f"bf16 path {res['path']} ({res['reason']}); left alone: {res['auto']}" if bf16 else \
        f"float32 (no bf16 products; left alone bf16 would take: {res['auto']})"
    lines = [f"\n{kind}, {path}",
             f"  CPU features {' '.join(res['features'])}; ATen {res['capability']}; copy bandwidth "
             f"{bw / 1e9:.1f} GB/s; load {res['load_before'][0]:.2f} -> {res['load_after'][0]:.2f}",
             f"  compiled graphs' {res['f32']}",
             f"  {'cell':<26}{'tok/s':>8}{'e2e tok/s':>11}{'prefill ms':>12}{'compile s':>11}{'of bound':>10}"
             f"{'x upstream decode':>19}{'x e2e':>8}  step"]
    for spec, c in res["cells"].items():
        if spec == "v1":
            lines.append(f"  v1 bf16 encode {c['encode_ms']:.1f} ms; compiled batch-1 decode {c['decode_tok_s']:.1f} "
                         f"tok/s end to end (compile {c['compile_s']:.1f} s)")
            continue
        dtype, batch, mode = spec.split(",")
        bound = int(batch) * bw / c["bytes"]
        decode_ref, e2e_ref = upstream_rates(int(batch), new)
        comp = "-" if c["compile_s"] is None else f"{c['compile_s']:.1f}"
        lines.append(f"  {dtype + ' b' + batch + ' ' + mode:<26}{c['tok_s']:>8.1f}{c['e2e_tok_s']:>11.1f}"
                     f"{c['prefill_ms']:>12.0f}{comp:>11}{c['tok_s'] / bound:>10.0%}{c['tok_s'] / decode_ref:>18.1f}x"
                     f"{c['e2e_tok_s'] / e2e_ref:>7.1f}x  {c['step']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--bf16-paths", nargs="+", default=["native", "upcast"], choices=["native", "upcast", "auto"],
                        help="the bf16 paths to force, one process each (native is emulated, and slow, on a CPU "
                             "without bf16 units; auto forces none: kernels.bf16_path picks)")
    parser.add_argument("--f32-paths", nargs="+", default=[""], choices=["", "onednn", "library"],
                        help="the float32 product paths of compiled graphs to force (NEEDLE_TWIN_F32), one process "
                             "each; '' (the default) leaves the choice to kernels.f32_path")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="rows up to which compiled steps take the C++ kernels (default cpu_decode.max_rows: "
                             "MAX_ROWS, BF16_MAX_ROWS for bf16 on the CPU's bf16 units): for measuring where they "
                             "stop paying")
    parser.add_argument("--kinds", nargs="+", default=["this", "avx2"], choices=["this", "avx2"],
                        help="this CPU as it is, and/or an AVX2-only CPU (AVX2_ENV)")
    parser.add_argument("--no-emulate", dest="emulate", action="store_false", help="skip the AVX2-only runs")
    parser.add_argument("--v1", action="store_true", help="also Needle v1's torch encode and compiled decode")
    parser.add_argument("--upstream", nargs="+", default=[], metavar="KEY=VALUE",
                        help="upstream's figures measured on this machine (benchmarks/bench_flax_v2.py) in place of "
                             f"the issue's: keys {', '.join(UPSTREAM)}")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="where the results go as JSON (default benchmarks/results/torch-v2-<UTC time>.json)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cells", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    UPSTREAM.update(upstream_overrides(args.upstream))  # read by upstream_rates in this (the parent) process
    source = "measured here, given with --upstream" if args.upstream else "the issue's, from a 2-core AVX2 EPYC"
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, {args.threads} threads; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; upstream's figures ({source}): {UPSTREAM}")
    print(f"runtime settings ({', '.join(RUNTIME_ENV)}): {runtime_settings(os.environ)}")
    kinds = [(name, env) for key, name, env in (("this", "this CPU", {}), ("avx2", "AVX2-only (emulated)", AVX2_ENV))
             if key in args.kinds and (key == "this" or args.emulate)]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs = []
    for kind, env in kinds:
        for dtype in args.dtype:
            paths = args.bf16_paths if dtype == "bfloat16" else [""]  # float32 takes no bf16 path
            for forced in paths:
                for f32 in args.f32_paths:
                    cells = [f"{dtype},{b},{m}" for b in args.batch for m in args.modes]
                    if args.v1 and dtype == "bfloat16":
                        cells.append("v1")
                    res = spawn(cells, {**env, **({BF16_PATH_ENV: forced} if forced not in ("", "auto") else {}),
                                        **({F32_PATH_ENV: f32} if f32 else {})}, args)
                    for line in report(kind, res, args.new_tokens):
                        print(line, flush=True)
                    runs.append(result_record(kind, env, res))
    print(f"\nload average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    default = REPO / "benchmarks" / "results" / f"torch-v2-{started.replace(':', '')}.json"
    path = Path(args.json) if args.json else default
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "torch-v2", "date": started, "command": " ".join(
        ["python", "benchmarks/bench_torch_v2.py", *sys.argv[1:]]), "machine": machine(), "threads": args.threads,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats,
        "runtime_settings": runtime_settings(os.environ), "runs": runs}, indent=1) + "\n")
    print(f"results: {path.relative_to(REPO) if path.is_relative_to(REPO) else path}")


def machine() -> dict:
    """The CPU, its flags that decide the kernels' paths, the core count and torch's version."""
    flags = cpu_flags()
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16")
    return {"cpu": cpuinfo("model name") or "unknown", "vendor": cpuinfo("vendor_id") or "unknown",
            "cpus": os.cpu_count(), "flags": [f for f in wanted if f in flags],
            "absent": [f for f in wanted if f not in flags], "torch": torch.__version__}


def result_record(kind: str, env: dict, res: dict) -> dict:
    """One process's figures for the JSON results: each cell with its share of the memory bound, and each fast mode's
    ratio to its plain twin (plain-compiled for compiled, plain-compiled-all for compiled-all) where both ran."""
    cells = {}
    for spec, c in res["cells"].items():
        if spec == "v1":
            cells[spec] = c
            continue
        dtype, batch, mode = spec.split(",")
        bound = int(batch) * res["bandwidth"] / c["bytes"]
        cells[spec] = {**c, "dtype": dtype, "batch": int(batch), "mode": mode, "bound_tok_s": bound,
                       "of_bound": c["tok_s"] / bound}
    for spec, c in list(cells.items()):
        plain = cells.get(spec.replace(f",{c.get('mode')}", f",plain-{c.get('mode')}")) if "mode" in c else None
        if plain is not None and not c["mode"].startswith("plain"):
            c["vs_plain"] = {"tok_s": c["tok_s"] / plain["tok_s"], "e2e_tok_s": c["e2e_tok_s"] / plain["e2e_tok_s"],
                             "prefill": plain["prefill_ms"] / c["prefill_ms"]}
    return {"kind": kind, "env": env, "bf16_path": res["path"], "bf16_reason": res["reason"],
            "features": res["features"], "aten": res["capability"], "f32_path": res["f32"],
            "bandwidth_bytes_s": res["bandwidth"], "load_before": res["load_before"], "load_after": res["load_after"],
            "cells": cells}


if __name__ == "__main__":
    main()
