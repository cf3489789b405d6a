"""Wall time and peak memory of `needle-twin convert` on a >= 1B-parameter float16 checkpoint, beside `cp`.

Generates a synthetic Needle-architecture upstream pickle (random weights, written layer by
layer so generation itself stays small), then in one run, side by side:
  cp big.pkl                         vs  needle-twin convert big.pkl big.safetensors
  cp big.safetensors                 vs  needle-twin convert big.safetensors back.pkl
Each conversion runs as its own process; its peak RSS comes from wait4() for that process. Every
timed command starts after `sync` (no inherited writeback). The converter writes with O_DIRECT where
the filesystem allows it, so its time includes putting the bytes on the device; plain `cp` leaves them
dirty in the page cache, so it is timed both alone (the target's reference) and followed by `sync`.
Targets (issue 3): time <= 3x cp; peak RSS <= 1.5x the checkpoint size from a pickle,
<= 0.5x from safetensors. back.pkl must be byte-identical to big.pkl (checked with cmp).

Usage: python benchmarks/bench_convert.py [--dir DIR] [--d-model 2048] [--layers 24] [--vocab 32000] [--repeat 2]
Needs about 5x the checkpoint size of free disk (checked first) and ~1.5x of free RAM.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from convert.config import TransformerConfig, count_parameters  # noqa: E402
from convert.formats import upstream_pickle  # noqa: E402
from convert.mapping import flax_shape, rules  # noqa: E402
from convert.plan import Piece, Planned  # noqa: E402
from convert.tensors import TensorRef  # noqa: E402


def synthetic_config(d_model: int, layers: int, vocab: int) -> TransformerConfig:
    heads = max(2, d_model // 128)  # head_dim 128, as in common 1B models
    return TransformerConfig(vocab_size=vocab, d_model=d_model, num_heads=heads, num_kv_heads=heads,
                             num_encoder_layers=layers, num_decoder_layers=layers, max_seq_len=2048)


def write_synthetic_pickle(path: Path, config: TransformerConfig, seed: int = 0) -> None:
    """Upstream-format pickle of random float16 weights, generated one layer slice at a time."""

    def piece(shape: tuple[int, ...], *key: int):
        # One generator per piece: the pieces are filled on several threads, in any order.
        return lambda: (np.random.default_rng((seed, *key)).standard_normal(shape, dtype=np.float32)
                        * 0.02).astype(np.float16)

    tensors = {}
    for k, rule in enumerate(rules(config)):
        shape = flax_shape(rule, config)
        f16 = np.dtype(np.float16)
        if rule.stack:
            pieces = tuple(Piece(TensorRef(shape[1:], f16, piece(shape[1:], k, i))) for i in range(shape[0]))
        else:
            pieces = (Piece(TensorRef(shape, f16, piece(shape, k))),)
        tensors[rule.flax] = Planned(rule.flax, shape, f16, pieces, stacked=rule.stack is not None)
    upstream_pickle.write(path, tensors, config.to_dict(only_non_default=True))


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process.

    Linux starts a child's max-RSS at its parent's RSS at fork time, so this process keeps itself small
    (the checkpoint is generated in a subprocess) and the floor is stated in the report. Every command starts
    after a sync, so none is throttled by dirty pages an earlier one left for the disk.
    """
    os.sync()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}")
    return wall, usage.ru_maxrss * 1024  # Linux reports KiB


def convert_cmd(src: Path, dst: Path) -> list[str]:
    return [sys.executable, "-m", "cli", "convert", str(src), str(dst), "--quiet", "--force"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24, help="encoder layers = decoder layers")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeat", type=int, default=2, help="runs of each command; the fastest is reported")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--generate", type=Path, default=None, help=argparse.SUPPRESS)  # internal: child mode
    args = parser.parse_args()
    if args.generate is not None:
        write_synthetic_pickle(args.generate, synthetic_config(args.d_model, args.layers, args.vocab))
        return

    config = synthetic_config(args.d_model, args.layers, args.vocab)
    params = count_parameters(config)
    size = params * 2
    work = Path(tempfile.mkdtemp(prefix="needle-bench-", dir=args.dir))
    free = shutil.disk_usage(work).free
    print(f"config: d_model={config.d_model} heads={config.num_heads} layers={config.num_encoder_layers}+"
          f"{config.num_decoder_layers} vocab={config.vocab_size} -> {params:,} parameters, "
          f"{size / 1e9:.2f} GB float16; work dir {work} ({free / 1e9:.0f} GB free)")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, cpus: {os.cpu_count()}")
    if free < 5.5 * size:
        raise SystemExit(f"need ~{5.5 * size / 1e9:.0f} GB free disk in {work}, have {free / 1e9:.0f} GB")
    try:
        pkl, st, back = work / "big.pkl", work / "big.safetensors", work / "back.pkl"
        t = time.perf_counter()
        subprocess.run([sys.executable, __file__, "--generate", str(pkl), "--d-model", str(args.d_model),
                        "--layers", str(args.layers), "--vocab", str(args.vocab)], check=True)
        print(f"generated {pkl.name}: {pkl.stat().st_size:,} bytes in {time.perf_counter() - t:.1f}s")
        own_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

        baseline_wall, baseline_rss = timed([sys.executable, "-c", "import cli, convert.io, numpy"])
        rows = []
        for label, src, dst in (("pickle -> safetensors", pkl, st), ("safetensors -> pickle", st, back)):
            cp_times, cp_sync_times, runs = [], [], []
            for _ in range(args.repeat):
                copy = work / f"copy{src.suffix}"
                cp_times.append(timed(["cp", str(src), str(copy)])[0])
                copy.unlink()
                cp_sync_times.append(timed(["sh", "-c", f"cp '{src}' '{copy}' && sync"])[0])
                copy.unlink()
                runs.append(timed(convert_cmd(src, dst)))
            wall = min(w for w, _ in runs)
            rss = max(r for _, r in runs)
            rows.append((label, src.stat().st_size, min(cp_times), min(cp_sync_times), wall, rss))
        same = subprocess.run(["cmp", "-s", str(pkl), str(back)]).returncode == 0

        print(f"\npython + imports alone: {baseline_wall:.2f}s, peak RSS {baseline_rss / 2**20:.0f} MiB "
              f"(included in every convert figure below; this script's own RSS, a floor: {own_rss / 2**20:.0f} MiB)")
        print(f"{'conversion':<24}{'size GB':>9}{'cp s':>8}{'cp+sync s':>11}{'convert s':>11}{'time/cp':>9}"
              f"{'target':>8}{'/cp+sync':>10}{'peak RSS GB':>13}{'RSS/size':>10}{'target':>8}")
        for label, nbytes, cp_s, cp_sync_s, conv_s, rss in rows:
            rss_target = 1.5 if label.startswith("pickle") else 0.5
            print(f"{label:<24}{nbytes / 1e9:>9.2f}{cp_s:>8.2f}{cp_sync_s:>11.2f}{conv_s:>11.2f}"
                  f"{conv_s / cp_s:>8.2f}x{'<=3x':>8}{conv_s / cp_sync_s:>9.2f}x"
                  f"{rss / 1e9:>13.2f}{rss / nbytes:>9.2f}x{f'<={rss_target}x':>8}")
        print(f"\nback.pkl byte-identical to big.pkl: {same}")
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if not same:
            raise SystemExit("round trip changed the checkpoint")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
