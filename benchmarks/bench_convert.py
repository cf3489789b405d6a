"""Wall time and peak memory of `needle-twin convert`, beside `cp`, with each writer (plain and O_DIRECT ring).

Generates synthetic upstream pickles (random weights, written layer by layer so generation itself
stays small) at the published sizes and at a >= 1B-parameter size:
  v1-26M     Needle v1 published config, float32 (105 MB)
  v2-45M     Needle 2 `base` preset with both heads, float32 (181 MB), a format-v2 pickle
  big-1.27B  a Needle v1-architecture model, float16 (2.55 GB)
then in one run, side by side, for each file and each writer (NEEDLE_TWIN_WRITER=plain|ring):
  cp X.pkl                  vs  needle-twin convert X.pkl X.safetensors
  cp X.safetensors          vs  needle-twin convert X.safetensors back.pkl
Each conversion runs as its own process; its peak RSS comes from wait4() for that process. Every
timed command starts after `sync` (no inherited writeback). The ring writes with O_DIRECT where the
filesystem allows it, so its time includes putting the bytes on the device; `cp` and the plain writer
leave them dirty in the page cache, so `cp` is timed both alone and followed by `sync`.
Targets (issue 3): time <= 3x cp; peak RSS <= 1.5x the checkpoint size from a pickle, <= 0.5x from
safetensors. back.pkl must be byte-identical to X.pkl (checked with cmp) for every writer.

Usage: python benchmarks/bench_convert.py [--dir DIR] [--sizes v1-26M,v2-45M,big-1.27B] [--repeat 3]
Needs about 5x the largest checkpoint's size of free disk (checked first) and ~1.5x of free RAM.
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

from convert.formats import upstream_pickle  # noqa: E402
from convert.io import pickle_layout  # noqa: E402
from convert.plan import Piece, Planned  # noqa: E402
from convert.registry import family_of  # noqa: E402
from convert.tensors import TensorRef  # noqa: E402
from convert.v1.config import NEEDLE_V1_PUBLISHED, TransformerConfig  # noqa: E402
from convert.v2.config import NEEDLE_V2_PUBLISHED  # noqa: E402

WRITERS = ("plain", "ring")


def big_config(d_model: int = 2048, layers: int = 24, vocab: int = 32000) -> TransformerConfig:
    heads = max(2, d_model // 128)  # head_dim 128, as in common 1B models
    return TransformerConfig(vocab_size=vocab, d_model=d_model, num_heads=heads, num_kv_heads=heads,
                             num_encoder_layers=layers, num_decoder_layers=layers, max_seq_len=2048)


SIZES = {"v1-26M": (NEEDLE_V1_PUBLISHED, "float32"), "v2-45M": (NEEDLE_V2_PUBLISHED, "float32"),
         "big-1.27B": (big_config(), "float16")}


def write_synthetic_pickle(path: Path, config, dtype: str, seed: int = 0) -> None:
    """An upstream pickle of the config's family (every optional group) of random weights, one layer slice at a
    time."""
    family = family_of(config)
    dt = np.dtype(dtype)

    def piece(shape: tuple[int, ...], *key: int):
        # One generator per piece: the pieces are filled on several threads, in any order.
        return lambda: (np.random.default_rng((seed, *key)).standard_normal(shape, dtype=np.float32)
                        * 0.02).astype(dt)

    table = family.table(config)
    tensors = {}
    for k, rule in enumerate(table.rules):
        shape = table.flax_shape(rule)
        if rule.stack:
            pieces = tuple(Piece(TensorRef(shape[1:], dt, piece(shape[1:], k, i))) for i in range(shape[0]))
        else:
            pieces = (Piece(TensorRef(shape, dt, piece(shape, k))),)
        tensors[rule.flax] = Planned(rule.flax, shape, dt, pieces, stacked=rule.stack is not None)
    upstream_pickle.write(path, tensors, pickle_layout(family, config.upstream_dict(), {}))


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


def convert_cmd(src: Path, dst: Path, writer: str) -> list[str]:
    return ["env", f"NEEDLE_TWIN_WRITER={writer}", sys.executable, "-m", "cli", "convert", str(src), str(dst),
            "--quiet", "--force"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each command; the fastest is reported")
    parser.add_argument("--keep", action="store_true", help="keep the generated files")
    parser.add_argument("--generate", nargs=2, default=None, help=argparse.SUPPRESS)  # internal: child mode
    args = parser.parse_args()
    if args.generate is not None:
        config, dtype = SIZES[args.generate[0]]
        write_synthetic_pickle(Path(args.generate[1]), config, dtype)
        return

    sizes = [s for s in args.sizes.split(",") if s]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown --sizes {unknown}; use {', '.join(SIZES)}")
    work = Path(tempfile.mkdtemp(prefix="needle-bench-", dir=args.dir))
    free = shutil.disk_usage(work).free
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, cpus: {os.cpu_count()}; "
          f"work dir {work} ({free / 1e9:.0f} GB free)")
    own_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    baseline_wall, baseline_rss = timed([sys.executable, "-c", "import cli, convert.io, numpy"])
    print(f"python + imports alone: {baseline_wall:.2f}s, peak RSS {baseline_rss / 2**20:.0f} MiB (included in every "
          f"convert figure below; this script's own RSS, a floor: {own_rss / 2**20:.0f} MiB)\n")
    header = (f"{'file':<11}{'conversion':<24}{'writer':<7}{'size MB':>9}{'cp s':>7}{'cp+sync s':>10}{'convert s':>10}"
              f"{'/cp':>7}{'/cp+sync':>9}{'RSS MB':>8}{'RSS/size':>9}")
    try:
        for name in sizes:
            config, dtype = SIZES[name]
            family = family_of(config)
            params = family.table(config).num_parameters()
            size = params * np.dtype(dtype).itemsize
            if free < 5.5 * size:
                raise SystemExit(f"{name}: need ~{5.5 * size / 1e9:.1f} GB free disk in {work}, have "
                                 f"{free / 1e9:.0f} GB")
            pkl, st, back = work / f"{name}.pkl", work / f"{name}.safetensors", work / f"{name}.back.pkl"
            t = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--generate", name, str(pkl)], check=True)
            print(f"{name}: {family.title}, {params:,} parameters, {dtype}: {pkl.stat().st_size:,} bytes "
                  f"(generated in {time.perf_counter() - t:.1f}s)")
            print(header)
            for label, src, dst in (("pickle -> safetensors", pkl, st), ("safetensors -> pickle", st, back)):
                cp_times, cp_sync_times = [], []
                runs: dict[str, list[tuple[float, int]]] = {w: [] for w in WRITERS}
                for _ in range(args.repeat):  # interleaved: the machine's drift hits every column alike
                    copy = work / f"copy{src.suffix}"
                    cp_times.append(timed(["cp", str(src), str(copy)])[0])
                    copy.unlink()
                    cp_sync_times.append(timed(["sh", "-c", f"cp '{src}' '{copy}' && sync"])[0])
                    copy.unlink()
                    for writer in WRITERS:
                        runs[writer].append(timed(convert_cmd(src, dst, writer)))
                        if dst == back and subprocess.run(["cmp", "-s", str(pkl), str(back)]).returncode != 0:
                            raise SystemExit(f"{name}: the round trip through the {writer} writer changed the file")
                nbytes, cp_s, cp_sync_s = src.stat().st_size, min(cp_times), min(cp_sync_times)
                for writer in WRITERS:
                    wall, rss = min(w for w, _ in runs[writer]), max(r for _, r in runs[writer])
                    print(f"{name:<11}{label:<24}{writer:<7}{nbytes / 1e6:>9.0f}{cp_s:>7.2f}{cp_sync_s:>10.2f}"
                          f"{wall:>10.2f}{wall / cp_s:>6.2f}x{wall / cp_sync_s:>8.2f}x{rss / 1e6:>8.0f}"
                          f"{rss / nbytes:>8.2f}x")
            print("back.pkl byte-identical to the source pickle: True (every writer, every run)\n")
            for p in (pkl, st, back):
                p.unlink(missing_ok=True)
        print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
