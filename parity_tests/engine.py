"""The parity engine: run both twins on the same weights and inputs, compare every probe, return a Report.

Shared by the pytest suite and `needle-twin parity`, for every family: what to run and which
probes exist comes from the family's adapter (parity_tests.families). Both twins compute in
the profile's dtype on bit-identical weights (parity_tests.twins).

Modes:
  propagated  both twins run end to end; each probe's error includes drift from upstream stages.
  isolated    the torch run is fed the Flax value at every stage boundary (embeddings, block
              outputs, final norms; Needle 2: the lane state after each layer), so each probe's error
              is local to its stage.
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from convert.errors import NeedleTwinError
from convert.trees import flatten_tree
from parity_tests import metrics, probes
from parity_tests.devices import pinned_precision, precision_settings
from parity_tests.families import adapter_of
from parity_tests.gradients import gradient_parity
from parity_tests.inputs import Batch
from parity_tests.report import ProbeResult, Report, score
from parity_tests.tolerances import Profile, device_class, get_profile
from parity_tests.twins import Twins, build_twins

MODES = ("propagated", "isolated")


# ----------------------------------------------------------------------------- comparing


def compare_probes(table: list[probes.Probe], test: Mapping[str, np.ndarray],
                   ref: Mapping[str, np.ndarray]) -> list[ProbeResult]:
    """Unjudged metrics for every probe, in table (execution) order."""
    out = []
    for p in table:
        m: dict[str, float | None] = metrics.compare(test[p.name], ref[p.name])
        if p.name == "logits":
            m.update(metrics.compare_logits(test[p.name], ref[p.name]))
        out.append(ProbeResult(p.name, list(np.shape(ref[p.name])), m))
    return out


def count_params(params: Mapping[str, Any]) -> int:
    return int(sum(np.size(v) for v in flatten_tree(params).values()))


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(twins: Twins, seeds: Mapping[str, Any]) -> dict[str, Any]:
    """What a reader needs to reproduce the numbers: devices, precision, versions, seeds."""
    tdev = twins.torch_device
    torch_name = str(tdev)
    if tdev.type == "cuda":
        torch_name += f" ({torch.cuda.get_device_name(tdev)})"
    jd = twins.jax_device
    return {
        "devices": {"torch": torch_name, "jax": f"{jd.platform}:{jd.id} ({jd.device_kind})"},
        "precision": {"pinned": None, **precision_settings()},
        "versions": {"python": sys.version.split()[0], **{d: _version(d) for d in (
            "needle-twin", "numpy", "jax", "jaxlib", "flax", "torch", "ml_dtypes")}},
        "platform": platform.platform(),
        "machine": platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "seeds": dict(seeds),
    }


def run_parity(config, flax_params: Mapping[str, Any], batch: Batch, *,
               torch_params: Mapping[str, Any] | None = None, dtype: str = "float32", mode: str = "propagated",
               profile: Profile | None = None, torch_device_name: str = "cpu", jax_platform: str = "cpu",
               pin_precision: bool = True, grads: bool = True, generate: int = 8,
               suppress_tokens: Sequence[int] | None = None, model_info: Mapping[str, Any] | None = None,
               seeds: Mapping[str, Any] | None = None, lora: Any = None) -> Report:
    """Compare the twins probe by probe (and gradients and greedy generation); a judged Report.

    config: the family's config (its class picks the adapter). flax_params / torch_params: nested upstream
    Flax trees of numpy arrays (torch_params: a torch checkpoint already mapped to the Flax layout; None =
    convert flax_params in memory). grads and generate default to what `needle-twin parity` does: gradients
    on, 8 greedy steps (0 = none); suppress_tokens: ids greedy decoding may not pick. lora: an adapter (a family
    with LoRA, Needle 2): its A/B gradients are compared too (flax_params is the base; the probes run the base).
    """
    if mode not in MODES:
        raise NeedleTwinError(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    adapter = adapter_of(config)
    profile = profile or get_profile(adapter.budgets, dtype, device_class(torch_device_name, jax_platform))
    if profile.dtype != dtype:
        raise NeedleTwinError(f"tolerance profile {profile.name} is for {profile.dtype}, but the run computes in "
                              f"{dtype}; pick the {dtype} profile or drop --profile")
    note = None
    if adapter.prepare is not None:
        config, note = adapter.prepare(config, dtype, jax_platform)
    with pinned_precision(pin_precision):
        twins = build_twins(adapter, config, flax_params, dtype, torch_params, torch_device_name, jax_platform)
        table = adapter.probe_table(twins)
        ref = adapter.flax_probes(twins, batch)
        test = adapter.torch_probes(twins, batch, ref if mode == "isolated" else None)
        results = compare_probes(table, test, ref)
        gradients = gradient_parity(twins, batch) if grads else None
        lora_gradients = None
        if lora is not None:
            if adapter.lora_gradients is None:
                raise NeedleTwinError(f"the {adapter.family} family has no LoRA adapters; drop --lora")
            lora_gradients = adapter.lora_gradients(twins, batch, lora)
        generation = None
        if generate and adapter.generation is not None:
            generation = adapter.generation(twins, batch, generate, suppress_tokens)
        env = environment(twins, seeds or {})
        env["precision"]["pinned"] = pin_precision
    model = {"family": adapter.family, "config": config.to_dict(), **(model_info or {})}
    report = Report(mode=mode, dtype=dtype, num_params=count_params(flax_params), profile=profile, probes=results,
                    inputs=batch.describe(config.pad_token_id), model=model, environment=env, gradients=gradients,
                    generation=generation, lora_gradients=lora_gradients)
    report = score(report, profile)
    if note:
        report.notes.append(note)
    if mode == "propagated" and report.first_divergence is not None:
        report.notes.append("propagated errors include drift from every earlier stage; --mode isolated feeds each "
                            "torch stage the Flax input and shows that stage's own error")
    return report
