"""Shared by the converter tests: tiny configs and pickles written the upstream way, the CLI, its refusals."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from convert.mapping import random_flax_params
from convert.trees import flatten_tree
from convert.v1.config import TransformerConfig

REPO = Path(__file__).resolve().parents[1]
TINY = TransformerConfig(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, num_encoder_layers=1,
                         num_decoder_layers=2, max_seq_len=32)
TINY_FFN = TINY.replace(no_feedforward=False, d_ff=48, activation="swiglu", num_kv_heads=1)


def write_upstream_pickle(path: Path, params: dict, config: dict) -> Path:
    """What upstream does: plain pickle.dump of {"params": numpy tree, "config": explicitly set fields}."""
    with open(path, "wb") as f:
        pickle.dump({"params": params, "config": config}, f)
    return path


def read_pickle(path: Path) -> object:
    """A plain pickle.load, as upstream code reads its checkpoints."""
    with open(path, "rb") as f:
        return pickle.load(f)


def tiny_config_json(path: Path, config: TransformerConfig = TINY) -> Path:
    """config as a config.json-style file (every field), for --config or to sit beside a bare weights file."""
    path.write_text(json.dumps(config.to_dict()))
    return path


def tiny_pickle(path: Path, config: TransformerConfig = TINY, dtype: str = "float16", seed: int = 0) -> Path:
    params = random_flax_params(config, seed=seed, dtype=dtype)
    return write_upstream_pickle(path, params, config.to_dict(only_non_default=True))


def assert_trees_bit_identical(a: dict, b: dict) -> None:
    """Same paths, shapes, dtypes and bytes for every array."""
    fa, fb = flatten_tree(a), flatten_tree(b)
    assert sorted(fa) == sorted(fb), sorted(set(fa) ^ set(fb))
    for k in fa:
        x, y = np.asarray(fa[k]), np.asarray(fb[k])
        assert x.dtype == y.dtype, (k, x.dtype, y.dtype)
        assert x.shape == y.shape, (k, x.shape, y.shape)
        assert x.tobytes() == y.tobytes(), k


def leftovers(directory: Path) -> list[str]:
    """Temporary files/dirs our atomic writer would leave behind if cleanup failed."""
    return sorted(p.name for p in directory.iterdir() if ".needle-tmp-" in p.name or ".needle-old-" in p.name)


class RunsCommand:
    """A pickle payload that would create `marker` if unpickled by a stock unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def run_cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m cli ARGS` as a real process from the repository root."""
    return subprocess.run([sys.executable, "-m", "cli", *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def assert_refused(tmp_path: Path, src: Path, pattern: str, dst_name: str = "out.safetensors", *extra: str | Path,
                   process: bool = False, never: re.Pattern | None = None) -> str:
    """`convert` (in-process, or a real process) exits 2 with one `error:` line matching pattern; nothing written."""
    import cli  # here, not at import: the helpers serve tests that never run the CLI

    dst = tmp_path / dst_name
    args = ["convert", str(src), str(dst), *map(str, extra)]
    if process:
        result = run_cli(*args)
        code, details = result.returncode, (result.returncode, result.stdout, result.stderr)
    else:
        result = CliRunner().invoke(cli.app, args)
        code, details = result.exit_code, (result.exit_code, result.stdout, result.stderr, result.exception)
    message = result.stderr.strip()
    assert code == 2, details
    assert "\n" not in message and "Traceback" not in message, message
    assert message.startswith("error: ") and re.search(pattern, message), message
    assert never is None or not never.search(message), message
    assert not dst.exists(), f"{dst} was written"
    assert leftovers(tmp_path) == []
    return message
