"""Named capture points, identical for both twins, and how to read them without editing either model.

Each family's table (`parity_tests.<family>.probes.probe_table`) lists every probe in execution
order with where it lives in each twin: a path into the Flax "intermediates" collection (sown
values; scanned layers are stacked on axis 0, so a layer index picks the slice) and a torch
module whose forward hook sees the value. Boundary probes are stage outputs (embeddings, block outputs, final
norms): in isolated mode the torch run is fed the Flax value from each boundary onward,
so every stage's error is its own and not drift from earlier stages.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Probe:
    name: str  # canonical name, the same for both twins
    flax: tuple[str, ...]  # path in the Flax "intermediates" collection
    torch: str  # torch module whose forward output is the value
    layer: int | None = None  # index into the Flax stacked-layer axis
    boundary: bool = False  # a stage output: isolated mode substitutes the Flax value here
    pass_: str = "text"  # which forward pass of the family produces it (v1: "text" or "contrastive")


# ----------------------------------------------------------------------------- Flax


def read_flax(intermediates: Mapping[str, Any], probe: Probe) -> np.ndarray:
    """One probe's value from an "intermediates" collection (each sown value is a 1-tuple)."""
    node: Any = intermediates
    for key in probe.flax:
        if key not in node:
            raise KeyError(f"Flax intermediates have no {'/'.join(probe.flax)} (probe {probe.name})")
        node = node[key]
    value = np.asarray(node[0])
    return value if probe.layer is None else value[probe.layer]


def flax_probes(table: list[Probe], passes: Mapping[str, Mapping[str, Any]]) -> dict[str, np.ndarray]:
    """{probe name: numpy value} from the intermediates of each forward pass ({pass name: collection})."""
    return {p.name: read_flax(passes[p.pass_], p) for p in table}


# ----------------------------------------------------------------------------- torch


def _output_tensor(output: Any):
    """A block or tap returns a tensor; anything else means the model changed under the table."""
    import torch

    if not isinstance(output, torch.Tensor):
        raise TypeError(f"probe module returned {type(output).__name__}, expected a tensor")
    return output


@contextmanager
def torch_capture(model, table: list[Probe], substitute: Mapping[str, Any] | None = None,
                  ) -> Iterator[dict[str, Any]]:
    """Forward hooks on the table's modules; yields {probe name: detached tensor}, filled as the model runs.

    substitute: {probe name: tensor}. After capturing a boundary probe's own output, its hook
    returns the substitute instead, so downstream modules run on that (Flax) value.
    The first value a probe sees wins: later passes (the contrastive pass runs the encoder
    again) do not overwrite it. Hooks are removed on exit, even after an error.
    """
    modules = dict(model.named_modules())
    missing = sorted({p.torch for p in table} - set(modules))
    if missing:
        raise KeyError(f"torch model has no module(s) {', '.join(missing)} for the probe table")
    captured: dict[str, Any] = {}
    handles = []

    def hook_for(probe: Probe):
        def hook(module, args, output):
            if probe.name not in captured:  # no clone on a later pass: its value is not kept
                captured[probe.name] = _output_tensor(output).detach().clone()
            if substitute is not None and probe.boundary and probe.name in substitute:
                return substitute[probe.name]
            return None

        return hook

    try:
        for probe in table:
            handles.append(modules[probe.torch].register_forward_hook(hook_for(probe)))
        yield captured
    finally:
        for h in handles:
            h.remove()
