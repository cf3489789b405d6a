"""The one switch between the plain twins and their fast forms: `fast_paths(model)`.

The model files (needle_torch/v1, v2, v3) are the definition and know nothing of this package. While a
`fast_paths(model)` block runs, the pieces a family's fast module lists (`needle_torch.fast.<family>.SWAPS`) are
replaced by their fast forms, and the model's `nn.Linear` modules (and those the family's `module_swaps` names)
change class to a subclass with a fast forward and the same parameters (`LINEAR`); everything is put back when the
block ends, also on an error. A family that sets UPCAST_PRODUCTS runs a bf16 model's block under
kernels.UpcastProducts (bf16 products as float32 ones where the CPU has no bf16 units). Each piece is registered
once, in the family's `PIECES`, with what switches it off (`without`), so that a benchmark can weigh it on its own
and removing it is deleting its entry and its code.
Every fast form computes the same function as the piece it replaces, up to the order of float32 sums.

`generate(..., fast=True)` (the default) runs its request inside this block; `fast=False` runs the plain modules.
Needle 3's fast module also offers the compiled decoding step that `generate(..., compile=True)` takes through
`forms(model)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import ModuleType

from torch import nn

from needle_torch.fast import kernels


def forms(model: nn.Module) -> ModuleType | None:
    """The fast module of the model's family (`needle_torch.fast.<family>`), None for a family without one."""
    family = getattr(model, "family", None)
    if family is None:
        return None
    try:
        return importlib.import_module(f"needle_torch.fast.{family}")
    except ModuleNotFoundError as e:
        if e.name != f"needle_torch.fast.{family}":
            raise
        return None


@contextmanager
def fast_paths(model: nn.Module, on: bool = True) -> Iterator[ModuleType | None]:
    """Run the block with the model's family's fast forms in place (on) or the plain modules as written (off).

    Yields the family's fast module while on (its request hooks: kernels to build, cache state), else None."""
    fast = forms(model) if on else None
    if fast is None:
        with kernels.switched(False):
            yield None
        return
    swaps = [(owner, name, form, owner.__dict__[name]) for owner, name, form in fast.SWAPS]
    retyped = [(m, fast.LINEAR) for m in model.modules() if type(m) is nn.Linear] if fast.LINEAR else []
    retyped += list(fast.module_swaps(model))
    before = [(m, type(m)) for m, _ in retyped]
    try:
        for owner, name, form, _ in swaps:
            setattr(owner, name, form)
        for m, cls in retyped:
            m.__class__ = cls
        with kernels.switched(True), _products(fast, model):
            yield fast
    finally:
        for m, cls in reversed(before):
            m.__class__ = cls
        for owner, name, _, plain in reversed(swaps):
            setattr(owner, name, plain)


def _products(fast: ModuleType, model: nn.Module) -> AbstractContextManager:
    """kernels.UpcastProducts for a family that asks for it (UPCAST_PRODUCTS) and a model whose compute dtype is bf16
    (its products run in the config's dtype, whatever its parameters are stored in)."""
    bf16 = getattr(getattr(model, "config", None), "dtype", None) == "bfloat16"
    return kernels.UpcastProducts() if getattr(fast, "UPCAST_PRODUCTS", False) and bf16 else nullcontext()


@contextmanager
def without(pieces: dict, names: Iterable[str]) -> Iterator[None]:
    """Run the block with the named pieces of a family's PIECES switched off (their settings put back after)."""
    settings = [s for name in names for s in pieces[name].off]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in settings]
    try:
        for owner, attr, value in settings:
            setattr(owner, attr, value)
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)
