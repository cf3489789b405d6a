"""from_pretrained / save_pretrained for the torch twin: safetensors in, safetensors out, no JAX anywhere.

Loading goes through the same strict checks as `needle-twin convert` (every missing,
unexpected, mis-shaped or wrong-dtype tensor in one error; NaN/Inf refused), builds the
model on the meta device and assigns each tensor as it is read, so memory peaks at the
model's size rather than twice it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from convert import plan
from convert.errors import CheckpointError
from convert.io import HF_DIR, SAFETENSORS, infer_write_format, open_source, resolve_config, write_source
from convert.mapping import _torch_to_numpy, numpy_to_torch
from convert.source import TORCH, Source
from convert.tensors import TensorRef, is_finite, weight_dtype
from needle_torch.model import TORCH_DTYPES

if TYPE_CHECKING:
    from needle_torch.model import SimpleAttentionNetwork

_TORCH_DTYPES = {v: k for k, v in TORCH_DTYPES.items()}


def _dtype_name(dtype: torch.dtype | str | None) -> str | None:
    if dtype is None or isinstance(dtype, str):
        return dtype
    if dtype not in _TORCH_DTYPES:
        raise CheckpointError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return _TORCH_DTYPES[dtype]


def from_pretrained(cls: type[SimpleAttentionNetwork], path: str | Path, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None) -> SimpleAttentionNetwork:
    """Load a .safetensors file or HF-style directory (any readable checkpoint) into a new model in eval mode.

    dtype: None keeps the stored dtype (float16 stays float16); otherwise every tensor is cast to it.
    """
    source = open_source(path)
    config = resolve_config(source)
    name = _dtype_name(dtype)
    cast = weight_dtype(name) if name is not None else None
    plan.validate(source, config, cast)
    with torch.device("meta"):
        model = cls(config)  # no random init of weights we are about to replace
    state, bad = {}, []
    for p in plan.torch_view(source, config, cast):
        array = p.array()
        if not is_finite(array):
            bad.append(p.name)
            continue
        state[p.name] = numpy_to_torch(array).to(device) if device is not None else numpy_to_torch(array)
    if bad:
        raise plan.non_finite_error(source.path, bad, name)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def state_source(model: SimpleAttentionNetwork, name: str = "<torch model>") -> Source:
    """A model's state_dict as a torch-layout Source (host numpy, dtypes kept)."""
    tensors = {k: TensorRef.of(_torch_to_numpy(v)) for k, v in model.state_dict().items()}
    return Source(Path(name), "torch-module", TORCH, tensors, model.config.to_dict(), "the model's config")


def save_pretrained(model: SimpleAttentionNetwork, path: str | Path, *, force: bool = False,
                    max_shard_size: int | str | None = None) -> Path:
    """Write a .safetensors file (path ends in .safetensors) or an HF-style directory; atomic, no overwrite
    without force."""
    fmt = infer_write_format(path)
    if fmt not in (SAFETENSORS, HF_DIR):
        raise CheckpointError(f"save_pretrained writes .safetensors or a directory, not {Path(path).name!r}")
    return write_source(state_source(model), model.config, path, format=fmt, force=force,
                        max_shard_size=max_shard_size)


__all__ = ["from_pretrained", "save_pretrained", "state_source"]
