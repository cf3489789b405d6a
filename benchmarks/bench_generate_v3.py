"""Needle 3 generation speed at upstream's default config: upstream's loop, Flax cached, torch eager and compiled.

Upstream's default `TransformerConfig` (127.2M params; random weights, convert.mapping.random_flax_params(config,
seed=0), no heads), a 256-token prompt (BOS + random plain ids) and 64 new tokens, batch 1 and 16, float32 and
bfloat16 (weights and compute dtype), EOS never stopping our rows. Methods (cells are method/dtype/bN):
  upstream        upstream's `run.generate` in its own package and virtualenv, a subprocess
                  (benchmarks/upstream_generate_v3.py; NEEDLE_TELEMETRY=0 DO_NOT_TRACK=1): the whole PAD-filled buffer
                  re-run for every token. Upstream has no batched loop: at batch > 1 its loop body on a (B, M) buffer
                  for --upstream-steps steps (each step costs the same: one full forward).
  flax            needle_flax.v3.generate: one jit (prefill + a while_loop of cached steps)
  torch-eager     needle_torch.v3.generate
  torch-compiled  needle_torch.v3.generate with compile=True: the same loop, its one-token steps through
                  torch.compile with needle_torch.fast.v3's forms (few-row products as multiply-and-sums)
  torch-compiled-plain  the same with fast=False: the plain pieces compiled (what the fast forms must beat)
Reported per cell:
  tok/s           end to end: new tokens / the whole request (prefill included), best of --repeats
  decode tok/s    the steps after the first token: B·(G - 1) / their time (torch: stamped by the streamer; Flax and
                  upstream: (request - prefill))
  prefill         time to the first token's logits (torch: stamped; Flax: a jitted prefill alone; upstream: one
                  forward on the buffer)
  compile         first request - a warm one (XLA for Flax and upstream; dynamo + inductor for torch compiled, a
                  fresh inductor cache per run)
  of bound        decode tok/s against the memory bound B·bandwidth / bytes a step must read: the stack's weights
                  (every layer and the mHC routing, final norm), the tied output rows (out_vocab or V) and the KV
                  ring over the mean attended length and the conv rows, in the compute dtype; not the gathered engram
                  tables (nor the engram key/value projections, stated apart). bandwidth: 2 × bytes / time of a
                  256 MiB copy into a preallocated, already written buffer (benchmarks/bandwidth.py), best of
                  numpy and torch, measured in the same run.
Targets (issue 49): torch cached float32 batch 1 >= 10x upstream's loop end to end and its decode >= 50 % of the
float32 bound; bf16 decode >= 50 % of the bf16 bound on CPUs with bf16 units (avx512_bf16, amx_bf16), never slower
than float32 on CPUs without; Flax cached >= 3x upstream's loop with compile <= 30 s.

Usage: python benchmarks/bench_generate_v3.py [--dtype float32 bfloat16] [--batch 1 16] [--repeats 2]
       [--methods upstream flax torch-eager torch-compiled-plain torch-compiled] [--only CELL ...]
       [--upstream-steps 4] [--threads N]
       [--prompt-len 256] [--new-tokens 64] [--quick] [--out NAME]
--only picks cells by prefix: `torch-compiled/float32/b1`, `torch-compiled/bfloat16`, `flax`. --quick: a tiny
config, 16-token prompt, 8 new tokens, batch 1 and 2 (a smoke run; its figures mean nothing). --out NAME writes
benchmarks/results/NAME.json (a path ending in .json is used as it is) for benchmarks/table.py. Run it on an
otherwise idle machine: the load average is printed before and after.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from convert.mapping import count_parameters, random_flax_params  # noqa: E402
from convert.v3 import TransformerConfig  # noqa: E402
from convert.v3.config import BOS_ID  # noqa: E402

FIRST_PLAIN_ID = 20  # PAD, EOS, BOS, UNK and 16 chat markers come first
METHODS = ("upstream", "flax", "torch-eager", "torch-compiled-plain", "torch-compiled")
NAMES = {"upstream": "upstream run.generate loop", "flax": "Flax cached", "torch-eager": "torch eager",
         "torch-compiled-plain": "torch plain + compile", "torch-compiled": "torch compiled"}
UPSTREAM_PYTHON = REPO / ".upstream-venv" / "bin" / "python"  # tools/upstream_goldens.sh builds it
QUICK_FIELDS = dict(vocab_size=512, d_model=64, num_heads=4, num_kv_heads=2, num_layers=4, qk_head_dim=16,
                    v_head_dim=16, engram_layers=(1, 3), engram_slots=61, global_layers=(3,), sliding_window=64,
                    max_seq_len=512, embedding_dim=16)
BF16_UNITS = ("avx512_bf16", "amx_bf16")
FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def load_line(when: str) -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {when}: {one:.2f} {five:.2f} {fifteen:.2f} ({os.cpu_count()} CPUs)"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


# ----------------------------------------------------------------------------- the bound


def step_bytes(cfg: TransformerConfig, batch: int, prompt: int, new: int) -> dict[str, int]:
    """Bytes one decode step must read, in the compute dtype: the stack (every layer's projections, taps, norms,
    Monarch MLP, mHC routing; the final norm), the tied output rows, the KV ring over the mean attended length of the
    G - 1 steps (local layers at most sliding_window keys) and the τ - 1 conv rows; the engram projections apart."""
    item = 2 if cfg.dtype == "bfloat16" else 4
    hq, hv = cfg.head_dims
    D, H, K, L = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.num_layers
    stack = count_parameters(cfg, groups=()) - cfg.vocab_size * D - sum(engram_parts(cfg))
    attended = []
    for i in range(L):
        local = cfg.sliding_window and i not in cfg.global_layers
        keys = [p + 1 for p in range(prompt, prompt + new - 1)]  # the query at p sees p + 1 keys causally
        attended.append(np.mean([min(k, cfg.sliding_window) if local else k for k in keys]))
    kv = int(sum(attended) * batch * K * (hq + hv) * item)
    conv = L * batch * max(cfg.qkv_conv_taps - 1, 0) * (H * hq + K * hq + K * hv) * item
    return {"stack": stack * item, "output": cfg.output_vocab * D * item, "kv": kv, "conv": conv,
            "engram_proj": 2 * cfg.num_sites * cfg.engram_heads_resolved * len(cfg.engram_orders)
            * cfg.engram_sub_dim * D * item}


def engram_parts(cfg: TransformerConfig) -> tuple[int, int]:
    """(tables, projections + taps) parameter counts of every engram site."""
    N = cfg.engram_heads_resolved * len(cfg.engram_orders)
    tables = cfg.num_sites * N * cfg.engram_slots * cfg.engram_sub_dim
    return tables, cfg.num_sites * (2 * N * cfg.engram_sub_dim * cfg.d_model + 4 * cfg.d_model)


def bandwidth(mib: int = 256) -> tuple[float, str]:
    from benchmarks.bandwidth import copy_bandwidth, numpy_copy_bandwidth

    numpy_bw, torch_bw = numpy_copy_bandwidth(mib), copy_bandwidth(mib)
    return max(numpy_bw, torch_bw), f"numpy {numpy_bw / 1e9:.1f} GB/s, torch {torch_bw / 1e9:.1f} GB/s"


# ----------------------------------------------------------------------------- the methods


def prompts_for(cfg: TransformerConfig, batch: int, prompt_len: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    prompts = rng.integers(FIRST_PLAIN_ID, cfg.vocab_size, (batch, prompt_len))
    prompts[:, 0] = BOS_ID
    return prompts


def after_prefill(tokens: int, e2e: float, prefill: float) -> float:
    """tokens / (e2e - prefill): the steps' rate where the prefill was timed apart; NaN where a noisy prefill took as
    long as the whole request (tiny sizes), rather than a meaningless huge rate."""
    return tokens / (e2e - prefill) if e2e > prefill else float("nan")


def run_upstream(cfg: TransformerConfig, batch: int, args) -> dict:
    """upstream_generate_v3.py in upstream's virtualenv: its figures for this (dtype, batch)."""
    fields = {} if not args.quick else {k: list(v) if isinstance(v, tuple) else v for k, v in QUICK_FIELDS.items()}
    cmd = [str(args.upstream_python), str(REPO / "benchmarks" / "upstream_generate_v3.py"), "--dtype", cfg.dtype,
           "--batch", str(batch), "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.upstream_repeats), "--config", json.dumps(fields)]
    if batch > 1:
        cmd += ["--steps", str(args.upstream_steps)]
    env = {**os.environ, "NEEDLE_TELEMETRY": "0", "DO_NOT_TRACK": "1", "PYTHONPATH": ""}
    proc = subprocess.run(cmd, env=env, cwd=tempfile.gettempdir(), capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            steps = r["steps"]
            # every step is one full forward; its first chooses token 0 (the prefill's role)
            decode = after_prefill(batch * (steps - 1), r["e2e_s"], r["prefill_s"])
            return {"e2e_tok_s": batch * steps / r["e2e_s"], "decode_tok_s": decode, "prefill_s": r["prefill_s"],
                    "compile_s": r["first_call_s"] - r["e2e_s"], "tokens": batch * steps}
    raise SystemExit(f"upstream's loop failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def run_flax(cfg: TransformerConfig, tree: dict, prompts: np.ndarray, args) -> dict:
    import jax
    import jax.numpy as jnp

    from needle_flax.v3 import SimpleAttentionNetwork
    from needle_flax.v3.generate import _layer_plan, decode_step, generate, new_cache

    model, params = SimpleAttentionNetwork(cfg), jax.tree.map(jnp.asarray, tree)
    B, P = prompts.shape
    G = args.new_tokens
    tokens = jnp.asarray(prompts, jnp.int32)
    request = lambda: jax.block_until_ready(generate(model, params, tokens, G, eos_token_id=None))  # noqa: E731
    first, _ = timed(request)
    e2e = min(timed(request)[0] for _ in range(args.repeats))
    plan = _layer_plan(cfg, P + G, None, None)

    @jax.jit
    def prefill(params, tokens):
        return decode_step(model, params, new_cache(model, B, P + G), tokens, 0, plan, last_only=True)[0]

    jax.block_until_ready(prefill(params, tokens))
    latency = min(timed(lambda: jax.block_until_ready(prefill(params, tokens)))[0] for _ in range(args.repeats))
    return {"e2e_tok_s": B * G / e2e, "decode_tok_s": after_prefill(B * (G - 1), e2e, latency), "prefill_s": latency,
            "compile_s": first - e2e, "tokens": B * G}


def run_torch(model, prompts: np.ndarray, compiled: bool, args, fast: bool = True) -> dict:
    import torch

    tokens = torch.from_numpy(prompts)
    B, G = prompts.shape[0], args.new_tokens

    def request() -> tuple[float, float]:
        """(time to the first token, time of the G - 1 steps after it)."""
        stamps = []
        start = time.perf_counter()
        model.generate(tokens, G, eos_token_id=None, streamer=lambda _: stamps.append(time.perf_counter()),
                       compile=compiled, fast=fast)
        return stamps[0] - start, stamps[-1] - stamps[0]

    first = sum(request())
    runs = [request() for _ in range(args.repeats)]
    e2e = min(p + d for p, d in runs)
    return {"e2e_tok_s": B * G / e2e, "decode_tok_s": B * (G - 1) / min(d for _, d in runs),
            "prefill_s": min(p for p, _ in runs), "compile_s": first - e2e if compiled else None, "tokens": B * G}


# ----------------------------------------------------------------------------- the grid


def wanted(cell: str, only: list[str]) -> bool:
    return not only or any(cell == o or cell.startswith(o.rstrip("/") + "/") for o in only)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batch", nargs="+", type=int, default=None, help="default 1 16 (--quick: 1 2)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--only", nargs="+", default=[], metavar="CELL",
                        help="cells method[/dtype[/bN]], e.g. torch-compiled/float32/b1")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--upstream-repeats", type=int, default=1)
    parser.add_argument("--upstream-steps", type=int, default=4, help="upstream's loop steps timed at batch > 1")
    parser.add_argument("--upstream-python", type=Path, default=UPSTREAM_PYTHON)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default 256 (--quick: 16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default 64 (--quick: 8)")
    parser.add_argument("--quick", action="store_true", help="a tiny config and sizes: a smoke run")
    parser.add_argument("--out", default=None, metavar="NAME", help="write benchmarks/results/NAME.json")
    args = parser.parse_args(argv)
    args.batch = args.batch or ([1, 2] if args.quick else [1, 16])
    args.prompt_len = args.prompt_len or (16 if args.quick else 256)
    args.new_tokens = args.new_tokens or (8 if args.quick else 64)
    bad = [o for o in args.only if o.split("/")[0] not in METHODS]
    if bad:
        print(f"--only {bad[0]}: a cell starts with a method ({', '.join(METHODS)}), e.g. torch-compiled/float32/b1",
              file=sys.stderr)
        return 2
    if args.new_tokens < 2 or args.prompt_len < 1 or min(args.batch) < 1:
        print("--new-tokens must be >= 2 (decode is timed after the first token), --prompt-len and --batch >= 1",
              file=sys.stderr)
        return 2
    cells = [(m, d, b) for m in args.methods for d in args.dtype for b in args.batch
             if wanted(f"{m}/{d}/b{b}", args.only)]
    if any(m == "upstream" for m, _, _ in cells) and not args.upstream_python.exists():
        print(f"no upstream virtualenv at {args.upstream_python}: build it with tools/upstream_goldens.sh, pass "
              "--upstream-python, or leave upstream out (--methods flax torch-eager torch-compiled)", file=sys.stderr)
        return 2
    # a cold inductor cache: the compile time is a first run's
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-"))

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from needle_torch.v3 import SimpleAttentionNetwork

    flags = cpu_flags()
    base = TransformerConfig(**QUICK_FIELDS) if args.quick else TransformerConfig()
    size = count_parameters(base, groups=())
    print(load_line("at the start"), flush=True)
    bw, how = bandwidth(32 if args.quick else 256)  # --quick: a smoke run, its figures mean nothing
    print(f"{cpu_name()}; flags {' '.join(f for f in FLAGS if f in flags)}; torch {torch.__version__} "
          f"({torch.get_num_threads()} threads); copy bandwidth {how}: using {bw / 1e9:.1f} GB/s", flush=True)
    print(f"{'quick config' if args.quick else 'upstream default config'} ({size / 1e6:.1f}M params), "
          f"{args.prompt_len}-token prompt, {args.new_tokens} new tokens", flush=True)
    print(f"  {'cell':<30}{'tok/s':>9}{'decode tok/s':>14}{'prefill ms':>12}{'compile s':>11}{'of bound':>10}",
          flush=True)

    results = {}
    for dtype in args.dtype:
        cfg = base.replace(dtype=dtype)
        todo = [(m, b) for m, d, b in cells if d == dtype]
        if not todo:
            continue
        tree = random_flax_params(cfg, seed=0, dtype=dtype, groups=())
        model = SimpleAttentionNetwork.from_flax(tree, cfg, dtype=dtype) if any(
            m.startswith("torch") for m, _ in todo) else None
        for method, batch in todo:
            prompts = prompts_for(cfg, batch, args.prompt_len)
            if method == "upstream":
                r = run_upstream(cfg, batch, args)
            elif method == "flax":
                r = run_flax(cfg, tree, prompts, args)
            else:
                r = run_torch(model, prompts, method.startswith("torch-compiled"), args,
                              fast=method != "torch-compiled-plain")
            sizes = step_bytes(cfg, batch, args.prompt_len, args.new_tokens)
            read = sizes["stack"] + sizes["output"] + sizes["kv"] + sizes["conv"]
            r["bound_tok_s"] = batch * bw / read
            r["of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]  # NaN with a NaN decode rate
            r["step_bytes"] = sizes
            results[(method, dtype, batch)] = r
            comp = "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"
            print(f"  {f'{method}/{dtype}/b{batch}':<30}{r['e2e_tok_s']:>9.1f}{r['decode_tok_s']:>14.1f}"
                  f"{1e3 * r['prefill_s']:>12.1f}{comp:>11}{r['of_bound']:>10.0%}", flush=True)
        del model, tree

    lines = targets(results, flags)
    for line in lines:
        print(line)
    print(load_line("at the end"))
    if args.out:
        write_results(args, results, flags, size, bw)
    return 0


def targets(results: dict, flags: set[str]) -> list[str]:
    """The issue's targets, each met / MISSED, for the cells that ran."""
    lines, r = [], results
    units = [f for f in BF16_UNITS if f in flags]
    for b in sorted({b for _, _, b in r}):
        up = r.get(("upstream", "float32", b))
        for m in ("torch-compiled", "torch-eager", "flax"):
            c = r.get((m, "float32", b))
            if c and up:
                need = 3 if m == "flax" else 10
                x = c["e2e_tok_s"] / up["e2e_tok_s"]
                lines.append(f"target b{b}: {m} float32 {x:.1f}x upstream's loop end to end (>= {need}x: "
                             f"{'met' if x >= need else 'MISSED'})")
        for m in ("torch-compiled", "torch-eager"):
            f32, bf16 = r.get((m, "float32", b)), r.get((m, "bfloat16", b))
            if f32:
                lines.append(f"target b{b}: {m} float32 decode {f32['of_bound']:.0%} of the float32 bound (>= 50 %: "
                             f"{'met' if f32['of_bound'] >= 0.5 else 'MISSED'})")
            if bf16 and units:
                ok = "met" if bf16["of_bound"] >= 0.5 else "MISSED"
                lines.append(f"target b{b}: {m} bfloat16 decode {bf16['of_bound']:.0%} of the bfloat16 bound "
                             f"(bf16 units {', '.join(units)}; >= 50 %: {ok})")
            elif bf16 and f32:
                x = bf16["decode_tok_s"] / f32["decode_tok_s"]
                lines.append(f"target b{b}: {m} bfloat16 decode {x:.2f}x float32's (no bf16 units; >= 1: "
                             f"{'met' if x >= 1 else 'MISSED'})")
        for d in ("float32", "bfloat16"):
            fast, plain = r.get(("torch-compiled", d, b)), r.get(("torch-compiled-plain", d, b))
            if fast and plain:
                x = fast["decode_tok_s"] / plain["decode_tok_s"]
                lines.append(f"fast forms b{b} {d}: decode {x:.2f}x plain + compile (a piece keeps its place at "
                             f">= 1.3x: {'yes' if x >= 1.3 else 'NO'})")
        fl = r.get(("flax", "float32", b))
        if fl:
            lines.append(f"target b{b}: flax float32 compile {fl['compile_s']:.1f} s (<= 30 s: "
                         f"{'met' if fl['compile_s'] <= 30 else 'MISSED'})")
    return lines


def write_results(args, results: dict, flags: set[str], size: int, bw: float) -> None:
    """benchmarks/results/<name>.json in benchmarks/table.py's schema."""
    path = Path(args.out) if args.out.endswith(".json") else REPO / "benchmarks" / "results" / f"{args.out}.json"
    rows = []
    for (method, dtype, batch), r in results.items():
        decoded = r["decode_tok_s"] == r["decode_tok_s"]  # not NaN
        row = {"benchmark": f"generate, {NAMES[method]}",
               "setting": f"Needle 3{' quick' if args.quick else ''}, {dtype}, batch {batch}",
               **({"decode_tok_s": round(r["decode_tok_s"], 1)} if decoded else {}),
               "e2e_tok_s": round(r["e2e_tok_s"], 1), "prefill_s": round(r["prefill_s"], 4)}
        if r["compile_s"] is not None:
            row["compile_s"] = round(r["compile_s"], 1)
        if method != "upstream" and decoded:
            row["of_bound"] = round(r["of_bound"], 3)
        up = results.get(("upstream", dtype, batch))
        if method != "upstream" and up:
            row["x_upstream"] = round(r["e2e_tok_s"] / up["e2e_tok_s"], 1)
        rows.append(row)
    machine = {"description": f"{os.cpu_count()}-core {cpu_name()}",
               "cpu_flags": [f for f in FLAGS if f in flags], "absent_flags": [f for f in FLAGS if f not in flags]}
    data = {"schema": "needle-twin/bench-result", "version": 1, "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "command": " ".join(["benchmarks/bench_generate_v3.py", *sys.argv[1:]]), "machine": machine,
            "setup": f"Needle 3 {'quick config' if args.quick else 'upstream default config'} ({size / 1e6:.1f}M "
                     f"params), random weights, {args.prompt_len}-token prompt, {args.new_tokens} new tokens; "
                     f"copy bandwidth {bw / 1e9:.1f} GB/s",
            "rows": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    print(f"results: {path}")


if __name__ == "__main__":
    sys.exit(main())
