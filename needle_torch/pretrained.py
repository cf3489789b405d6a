"""from_flax / from_pretrained / save_pretrained for every family's torch model: safetensors in and out, no JAX.

`Pretrained` is mixed into each family's top-level model. Loading goes through the same
strict checks as `needle-twin convert` (every missing, unexpected, mis-shaped or wrong-dtype
tensor in one error; NaN/Inf refused), builds the model on the meta device and assigns each
tensor as it is read, so memory peaks at the model's size rather than twice it. The family
is read from the file (our metadata, else its tensor names) and must be the class's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from convert import plan, registry
from convert.errors import CheckpointError, ConfigError
from convert.family import Family
from convert.io import HF_DIR, SAFETENSORS, infer_write_format, open_source, resolve_config, source_family, write_source
from convert.mapping import flax_to_torch_numpy
from convert.rules import TORCH
from convert.source import Source
from convert.tensors import TensorRef, is_finite, weight_dtype
from convert.trees import as_numpy, numpy_to_torch
from needle_torch.layers import TORCH_DTYPES

_DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype | str | None) -> str | None:
    """"bfloat16" for torch.bfloat16 or "bfloat16"; None stays None; anything else is refused with the choices."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in TORCH_DTYPES:
            raise ConfigError(f"dtype {dtype!r} is unknown; use one of {', '.join(TORCH_DTYPES)} (or a torch dtype)")
        return dtype
    if dtype not in _DTYPE_NAMES:
        raise CheckpointError(f"dtype {dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
    return _DTYPE_NAMES[dtype]


class Pretrained:
    """Mixin for a family's top-level torch model (an nn.Module whose first argument is the family's config)."""

    family: str  # the family's name in convert.registry

    @classmethod
    def for_groups(cls, config: Any, groups: tuple[str, ...]):
        """A model with these optional parameter groups (families without optional groups ignore them)."""
        return cls(config)

    @classmethod
    def _family(cls, config: Any) -> Family:
        family = registry.family_named(cls.family)
        if registry.family_of(config) is not family:
            raise ConfigError(f"{cls.__module__}.{cls.__name__} is the {family.title} model but the config is a "
                              f"{registry.family_of(config).title} config; use that family's model")
        return family

    @classmethod
    def from_flax(cls, params, config: Any, dtype: torch.dtype | str | None = None):
        """Build from a Flax param tree through the family's mapping; keeps the tree's dtype unless `dtype` (a torch
        dtype or its name, e.g. "bfloat16") is given. Optional groups the tree lacks are left out of the model."""
        name = dtype_name(dtype)
        family = cls._family(config)
        state = flax_to_torch_numpy(params, config)
        with torch.device("meta"):
            model = cls.for_groups(config, family.groups_in(state, TORCH, config))
        model.load_state_dict({k: numpy_to_torch(a) for k, a in state.items()}, strict=True, assign=True)
        return model.eval() if name is None else model.to(TORCH_DTYPES[name]).eval()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str | None = None,
                        device: torch.device | str | None = None):
        """Load a .safetensors file or HF-style directory (any readable checkpoint) into a new model in eval mode.

        dtype: None keeps the stored dtype (float16 stays float16); otherwise every tensor is cast to it."""
        source = open_source(path)
        if source_family(source).name != cls.family:
            raise CheckpointError(f"{path} holds a {source_family(source).title} checkpoint; load it with "
                                  f"needle_torch.{source_family(source).name}.SimpleAttentionNetwork (or "
                                  "needle_torch.from_pretrained, which picks the family)")
        return load(cls, source, dtype, device)

    def save_pretrained(self, path: str | Path, *, force: bool = False, max_shard_size: int | str | None = None):
        """Write path.safetensors or an HF-style directory (atomic; never over an existing path without force);
        the family is recorded in the metadata and config.json."""
        fmt = infer_write_format(path)
        if fmt not in (SAFETENSORS, HF_DIR):
            raise CheckpointError(f"save_pretrained writes .safetensors or a directory, not {Path(path).name!r}")
        return write_source(state_source(self), self.config, path, format=fmt, force=force,
                            max_shard_size=max_shard_size)

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.weight.device


def load(cls: type[Pretrained], source: Source, dtype: torch.dtype | str | None = None,
         device: torch.device | str | None = None):
    """An opened checkpoint as a `cls` model in eval mode, tensor by tensor (see the module doc)."""
    config = resolve_config(source)
    family = cls._family(config)
    name = dtype_name(dtype)
    cast = weight_dtype(name) if name is not None else None
    table = plan.validate(source, family, config, cast)
    with torch.device("meta"):
        model = cls.for_groups(config, family.groups_in(source.tensors, source.layout, config))
    state, bad = {}, []
    for p in plan.torch_view(source, table, cast):
        array = p.array()
        if not is_finite(array):
            bad.append(p.name)
            continue
        state[p.name] = numpy_to_torch(array).to(device) if device is not None else numpy_to_torch(array)
    if bad:
        raise plan.non_finite_error(source.path, bad, name)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def state_source(model: Any, name: str = "<torch model>") -> Source:
    """A model's state_dict as a torch-layout Source (host numpy, dtypes kept)."""
    tensors = {k: TensorRef.of(as_numpy(v)) for k, v in model.state_dict().items()}
    return Source(Path(name), "torch-module", TORCH, tensors, model.config.to_dict(), "the model's config",
                  family=model.family)


__all__ = ["Pretrained", "dtype_name", "load", "state_source"]
