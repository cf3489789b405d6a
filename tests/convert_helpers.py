"""Small builders shared by the converter tests: tiny configs, upstream pickles written the upstream way."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np

from convert.config import TransformerConfig
from convert.mapping import flatten_tree, random_flax_params

REPO = Path(__file__).resolve().parents[1]
TINY = TransformerConfig(vocab_size=64, d_model=32, num_heads=4, num_kv_heads=2, num_encoder_layers=1,
                         num_decoder_layers=2, max_seq_len=32)
TINY_FFN = TINY.replace(no_feedforward=False, d_ff=48, activation="swiglu", num_kv_heads=1)


def write_upstream_pickle(path: Path, params: dict, config: dict) -> Path:
    """What upstream does: plain pickle.dump of {"params": numpy tree, "config": explicitly set fields}."""
    with open(path, "wb") as f:
        pickle.dump({"params": params, "config": config}, f)
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
