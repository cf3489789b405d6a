"""Each fast piece against plain + torch.compile, on the request it serves, on two CPU kinds, in one run.

    python benchmarks/bench_fast_pieces.py                 # this CPU, and this CPU as an AVX2-only one
    python benchmarks/bench_fast_pieces.py --quick         # a tiny model: checks the script, measures nothing

Needle 2 at the published size (random weights), a 256-token prompt and 64 new tokens. For each CPU kind (this CPU
as it is; "avx2": ATen at AVX2, oneDNN capped at AVX2 and the C++ kernels and compiled graphs built as x86-64-v3 code,
benchmarks/bench_torch_v2.AVX2_ENV) and each request a piece serves, one process measures side by side:
  plain      generate(..., fast=False), with compile="all" for an eager request: plain modules under torch.compile
  fast       generate(..., fast=True): every piece in place
  without    fast with one piece switched off (needle_torch.fast.v2.PIECES, through needle_torch.fast.seam.without)
as end-to-end seconds, best of --repeats after a first (compiling) call. The bf16 batch-1 request also gives decode
tokens/s against the memory bound measured in the same process (bytes a step reads at the copy bandwidth into a
preallocated buffer). A piece pays when, on every kind, fast is >= 1.3x plain and >= 1.3x without.
Writes benchmarks/results/<--out>.json (rows for benchmarks/table.py) and
benchmarks/decisions/<--out>.json (each piece's figures and verdict).
"""

from __future__ import annotations

import argparse
import json
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
from benchmarks.bench_torch_v2 import AVX2_ENV, machine, step_bytes  # noqa: E402
from convert.mapping import random_flax_params  # noqa: E402
from convert.v2 import NEEDLE_V2_PUBLISHED  # noqa: E402
from convert.v2.config import BOS_ID, FIRST_PLAIN_ID  # noqa: E402
from needle_torch.fast import kernels, seam  # noqa: E402
from needle_torch.fast import v2 as fast_v2  # noqa: E402
from needle_torch.v2 import SimpleAttentionNetwork  # noqa: E402

BAR = 1.3  # the speed-up a fast piece must show on its request, against plain + compile and against its absence
FEW, MANY = 1, 16  # batch rows of a decode request (steps of few rows) and of a batched one

# request -> (dtype, batch, generate's compile argument); "steps" requests are judged by their whole request too
REQUESTS = {
    "bf16-b1-steps": ("bfloat16", FEW, True),
    "f32-b1-steps": ("float32", FEW, True),
    "f32-many-steps": ("float32", MANY, True),
    "f32-many-all": ("float32", MANY, "all"),
    "bf16-many-eager": ("bfloat16", MANY, False),
}
BOUND_REQUEST = "bf16-b1-steps"  # Needle 2 bf16 batch-1 decoding, also weighed against the memory bound


PIECES = fast_v2.PIECES  # piece -> the request it serves and what switches it off: registered in the seam


def model_for(dtype: str, quick: bool) -> SimpleAttentionNetwork:
    cfg = NEEDLE_V2_PUBLISHED
    if quick:  # a tiny model of the published shape's kind: the script's check, not a measurement
        cfg = cfg.replace(d_model=64, attn_dim=64, num_heads=4, num_kv_heads=2, num_layers=2, vocab_size=512,
                          engram_slots=256, engram_layers=(0, 1))
    return SimpleAttentionNetwork.from_flax(random_flax_params(cfg, seed=0, groups=()), cfg, dtype=dtype)


def timed_request(model, prompts, new: int, compile, fast: bool, repeats: int) -> tuple[float, float]:
    """(best end-to-end seconds, best seconds of the steps after the first token) of `repeats` requests after a first
    one (which compiles)."""
    def run():
        stamps = []
        start = time.perf_counter()
        model.generate(prompts, new, eos_token_id=None, compile=compile, fast=fast,
                       streamer=lambda _: stamps.append(time.perf_counter()))
        return stamps[-1] - start, stamps[-1] - stamps[0]
    run()
    runs = [run() for _ in range(repeats)]
    return min(e for e, _ in runs), min(d for _, d in runs)


def child(args) -> None:
    torch.set_num_threads(args.threads)
    dtype, batch, compile = REQUESTS[args.request]
    model = model_for(dtype, args.quick)
    rng = np.random.default_rng(1)
    prompts = rng.integers(FIRST_PLAIN_ID, model.config.vocab_size, (batch, args.prompt_len))
    prompts[:, 0] = BOS_ID
    prompts = torch.from_numpy(prompts)
    out = {"load_before": os.getloadavg()[0], "aten": torch.backends.cpu.get_cpu_capability(),
           "bf16_path": str(kernels.bf16_path()), "f32_path": str(kernels.f32_path())}
    plain_compile = "all" if compile is False else compile
    out["plain_s"], plain_decode = timed_request(model, prompts, args.new_tokens, plain_compile, False, args.repeats)
    out["fast_s"], fast_decode = timed_request(model, prompts, args.new_tokens, compile, True, args.repeats)
    steps = batch * (args.new_tokens - 1)
    out["plain_decode_tok_s"], out["fast_decode_tok_s"] = steps / plain_decode, steps / fast_decode
    # the memory bound of a step, measured in this process: bytes a step must read at the copy bandwidth into a
    # preallocated buffer (benchmarks/bandwidth.py)
    item = torch.finfo(model.dtype).bits // 8
    out["bandwidth"] = copy_bandwidth()
    out["bound_tok_s"] = batch * out["bandwidth"] / step_bytes(model.config, batch, args.prompt_len,
                                                               args.new_tokens, item)
    out["without_s"] = {}
    for piece in filter(None, args.child_pieces.split(",")):
        with seam.without(PIECES, [piece]):
            torch._dynamo.reset()  # a fresh trace: the switched-off piece must not hide in a cached graph
            out["without_s"][piece] = timed_request(model, prompts, args.new_tokens, compile, True, args.repeats)[0]
        torch._dynamo.reset()
    out["load_after"] = os.getloadavg()[0]
    print("RESULT " + json.dumps(out), flush=True)


def spawn(request: str, pieces: list[str], env: dict, cache: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", "--request", request, "--child-pieces", ",".join(pieces), "--threads",
           str(args.threads), "--repeats", str(args.repeats), "--new-tokens", str(args.new_tokens), "--prompt-len",
           str(args.prompt_len), *(["--quick"] if args.quick else [])]
    proc = subprocess.run(cmd, env={**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": cache}, capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"a benchmark process failed ({request}, {env}):\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", nargs="+", default=list(PIECES), choices=list(PIECES))
    parser.add_argument("--kinds", nargs="+", default=["this", "avx2"], choices=["this", "avx2"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="a tiny model, 8 tokens: checks the script, measures "
                                                              "nothing")
    parser.add_argument("--out", default=None, metavar="STEM", help="file stem of the two JSON outputs")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--request", default="", help=argparse.SUPPRESS)
    parser.add_argument("--child-pieces", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)
    if args.quick:
        args.new_tokens, args.prompt_len, args.repeats = 4, 8, 1
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    kinds = [(key, name, env) for key, name, env in (("this", "this CPU", {}), ("avx2", "AVX2-only (emulated)",
                                                                               AVX2_ENV)) if key in args.kinds]
    by_request: dict[str, list[str]] = {BOUND_REQUEST: []}  # the memory bound's request runs whatever the pieces
    for piece in args.pieces:
        by_request.setdefault(PIECES[piece].serves, []).append(piece)
    figures: dict[str, dict[str, dict]] = {}
    for key, name, env in kinds:
        # one inductor cache per kind: AVX-512 code is never reused by the AVX2-only runs
        with tempfile.TemporaryDirectory(prefix="inductor-") as cache:
            for request, pieces in by_request.items():
                res = spawn(request, pieces, env, cache, args)
                figures.setdefault(key, {})[request] = res
                if request == BOUND_REQUEST:
                    print(f"{name:<22}{'decode vs bound':<18}{request:<17} plain {res['plain_decode_tok_s']:8.1f} "
                          f"tok/s  fast {res['fast_decode_tok_s']:8.1f} tok/s  bound {res['bound_tok_s']:8.1f} tok/s "
                          f"({res['bandwidth'] / 1e9:.1f} GB/s)  fast "
                          f"{res['fast_decode_tok_s'] / res['bound_tok_s']:.0%} of the bound", flush=True)
                for piece in pieces:
                    fast, plain, without = res["fast_s"], res["plain_s"], res["without_s"][piece]
                    print(f"{name:<22}{piece:<18}{request:<17} plain {plain:8.3f} s  fast {fast:8.3f} s  without "
                          f"{without:8.3f} s  x plain {plain / fast:5.2f}  x without {without / fast:5.2f}  load "
                          f"{res['load_before']:.1f}->{res['load_after']:.1f}", flush=True)
    decisions, rows = [], []
    for piece in args.pieces:
        request = PIECES[piece].serves
        per_kind = {}
        for key, _, _ in kinds:
            res = figures[key][request]
            per_kind[key] = {"plain_s": res["plain_s"], "fast_s": res["fast_s"], "without_s": res["without_s"][piece],
                             "vs_plain": res["plain_s"] / res["fast_s"],
                             "vs_without": res["without_s"][piece] / res["fast_s"]}
        keep = all(k["vs_plain"] >= BAR and k["vs_without"] >= BAR for k in per_kind.values())
        decisions.append({"piece": piece, "request": request,
                          "request_args": dict(zip(("dtype", "batch", "compile"), REQUESTS[request], strict=True)),
                          "keep": keep and not args.quick, "kinds": per_kind})
    for key, name, _ in kinds:
        for request, res in figures[key].items():
            dtype, batch, compile = REQUESTS[request]
            setting = f"{name}: Needle 2 {dtype} batch {batch} compile={compile!r}, {args.prompt_len}-token prompt"
            e2e = batch * args.new_tokens
            rows.append({"benchmark": "generate, torch plain + compile", "setting": setting,
                         "decode_tok_s": res["plain_decode_tok_s"], "e2e_tok_s": e2e / res["plain_s"],
                         "of_bound": res["plain_decode_tok_s"] / res["bound_tok_s"]})
            rows.append({"benchmark": "generate, torch fast", "setting": setting,
                         "decode_tok_s": res["fast_decode_tok_s"], "e2e_tok_s": e2e / res["fast_s"],
                         "of_bound": res["fast_decode_tok_s"] / res["bound_tok_s"]})
    stem = args.out or f"fast-pieces-{started.replace(':', '')}"
    command = " ".join(["python", "benchmarks/bench_fast_pieces.py", *sys.argv[1:]])
    info = machine()
    # a --quick run measures nothing: its files go to a temporary folder, never into the table
    base = Path(tempfile.mkdtemp(prefix="bench-quick-")) if args.quick else REPO / "benchmarks"
    (base / "results").mkdir(exist_ok=True)
    (base / "decisions").mkdir(exist_ok=True)
    results, decided = base / "results" / f"{stem}.json", base / "decisions" / f"{stem}.json"
    results.write_text(json.dumps({
        "schema": "needle-twin/bench-result", "version": 1, "date": started[:10], "command": command,
        "machine": {"description": f"{info['cpu']}, {info['cpus']} CPUs, torch {info['torch']}",
                    "cpu_flags": info["flags"], "absent_flags": info["absent"]},
        "kinds": {key: env for key, _, env in kinds},
        "rows": rows}, indent=1) + "\n")
    decided.write_text(json.dumps({"benchmark": "fast-pieces-decisions", "date": started, "command": command,
                                   "bar": BAR, "quick": args.quick, "machine": info, "decisions": decisions},
                                  indent=1) + "\n")
    print(f"results: {results}\ndecisions: {decided}")


if __name__ == "__main__":
    main()
