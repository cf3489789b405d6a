"""Where the time of the README's main command goes: `needle-twin parity` on the embedded default model.

Runs the same phases as the command (published size, float32, batch 4 x 64/32, gradients, 8 greedy
steps) and prints wall and CPU seconds per phase, then the whole command timed as a subprocess.
Usage: .venv/bin/python benchmarks/parity_default.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parent.parent


class Clock:
    def __init__(self) -> None:
        self.rows: list[tuple[str, float, float]] = []

    def lap(self, name: str, fn):
        wall, cpu = time.perf_counter(), time.process_time()
        out = fn()
        self.rows.append((name, time.perf_counter() - wall, time.process_time() - cpu))
        return out


def main() -> None:
    clock = Clock()
    clock.lap("import jax, flax, torch", lambda: (__import__("jax"), __import__("flax"), __import__("torch")))
    from convert.mapping import random_flax_params
    from convert.v1.config import NEEDLE_V1_PUBLISHED, SPECIAL_IDS
    from parity_tests.engine import build_twins, flax_run, generation_section, pinned_precision, torch_run
    from parity_tests.gradients import gradient_parity
    from parity_tests.inputs import random_batch

    cfg = NEEDLE_V1_PUBLISHED
    params = clock.lap("random weights (26.3M)", lambda: random_flax_params(cfg, 0))
    batch = random_batch(cfg, 4, 64, 32, seed=0)
    with pinned_precision():
        twins = clock.lap("build both twins", lambda: build_twins(cfg, params, "float32"))
        clock.lap("Flax forward (compile + run)", lambda: flax_run(twins, batch))
        clock.lap("torch forward with hooks", lambda: torch_run(twins, batch))
        clock.lap("gradients (both, Flax compile)", lambda: gradient_parity(twins, batch))
        clock.lap("greedy generation, 8 steps", lambda: generation_section(twins, batch, 8, SPECIAL_IDS))

    wall = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "cli", "parity", "--quiet"], cwd=REPO, capture_output=True,
                          text=True)
    command = time.perf_counter() - wall

    width = max(len(r[0]) for r in clock.rows)
    print(f"{'phase':<{width}}  {'wall s':>7}  {'cpu s':>7}")
    for name, w, c in clock.rows:
        print(f"{name:<{width}}  {w:7.1f}  {c:7.1f}")
    print(f"{'sum of phases':<{width}}  {sum(r[1] for r in clock.rows):7.1f}  {sum(r[2] for r in clock.rows):7.1f}")
    print(f"`needle-twin parity` as a subprocess: {command:.1f} s wall, exit {done.returncode}; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
