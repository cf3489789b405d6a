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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from convert.errors import NeedleTwinError
from convert.trees import flatten_tree
from parity_tests import metrics, probes
from parity_tests.adapter import Adapter
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


def depth_note(report: Report, depths: Sequence[int], ref: Mapping[str, np.ndarray],
               test: Mapping[str, np.ndarray]) -> str:
    """Whether the twins agree at each compared depth rung (its probes are named `depth{d}.*`), and how close each
    twin's sliced rung model (`depth{d}.sliced_logits`, where the family has one) comes to its own
    subnetwork_only logits: the same function computed two ways, so it should hold to the probes' budget too."""
    failed = [d for d in depths if not all(p.passed for p in report.probes if p.name.startswith(f"depth{d}."))]
    rungs = ", ".join(map(str, depths))
    if not failed:
        note = f"depth rungs {rungs}: the twins agree on every rung"
    else:
        note = f"depth rungs {rungs}: the twins disagree at rung(s) {', '.join(map(str, failed))}"
    budget = report.profile.drift.max_rel
    sliced = [d for d in depths if f"depth{d}.sliced_logits" in ref]
    if sliced:
        worst = {side: max(metrics.max_rel(vals[f"depth{d}.sliced_logits"], vals[f"depth{d}.sub_logits"])
                           for d in sliced) for side, vals in (("Flax", ref), ("torch", test))}
        agree = "agree" if max(worst.values()) <= budget else "DISAGREE"
        note += (f"; sliced rung models vs subnetwork_only logits (rungs {', '.join(map(str, sliced))}): {agree}, "
                 f"worst max rel Flax {worst['Flax']:.2e}, torch {worst['torch']:.2e} (budget {budget:.2e})")
    return note


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


@dataclass(frozen=True)
class RunSpec:
    """How one parity run computes and what it compares, resolved once (`resolve`) and read by every stage."""

    adapter: Adapter  # the family's, looked up once
    config: Any  # the config both twins run (the family's `prepare` applied)
    dtype: str
    mode: str
    profile: Profile
    torch_device: str
    jax_platform: str
    pin_precision: bool
    grads: bool
    generate: int  # greedy steps (0 = none)
    suppress_tokens: tuple[int, ...] | None  # ids greedy decoding may not pick
    note: str | None  # what `prepare` changed, for the report
    depths: tuple[int, ...] = ()  # depth rungs compared too (`--depth`)


def resolve(adapter: Adapter, config: Any, *, dtype: str = "float32", mode: str = "propagated",
            profile: Profile | None = None, torch_device: str = "cpu", jax_platform: str = "cpu",
            pin_precision: bool = True, grads: bool = True, generate: int = 8,
            suppress_tokens: Sequence[int] | None = None, depth: str | None = None) -> RunSpec:
    """Check a run's options and fix them in a RunSpec; the defaults are what `needle-twin parity` does.

    profile: None = the family's for the dtype and devices. depth: `--depth d|all` (families with a ladder).
    """
    if mode not in MODES:
        raise NeedleTwinError(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    profile = profile or get_profile(adapter.budgets, dtype, device_class(torch_device, jax_platform))
    if profile.dtype != dtype:
        raise NeedleTwinError(f"tolerance profile {profile.name} is for {profile.dtype}, but the run computes in "
                              f"{dtype}; pick the {dtype} profile or drop --profile")
    run_config, note = adapter.prepare(config, dtype, jax_platform)
    return RunSpec(adapter, run_config, dtype, mode, profile, torch_device, jax_platform, pin_precision, grads,
                   generate, None if suppress_tokens is None else tuple(suppress_tokens), note,
                   adapter.depths(config, depth))


def run(spec: RunSpec, flax_params: Mapping[str, Any], batch: Batch, *,
        torch_params: Mapping[str, Any] | None = None, lora: Any = None, model_info: Mapping[str, Any] | None = None,
        seeds: Mapping[str, Any] | None = None) -> Report:
    """Compare the twins probe by probe (and gradients and greedy generation); a judged Report.

    flax_params / torch_params: nested upstream Flax trees of numpy arrays (torch_params: a torch checkpoint
    already mapped to the Flax layout; None = convert flax_params in memory). lora: an adapter of a family with
    LoRA (Needle 2, Needle 3): its A/B gradients are compared too (flax_params is the base; the probes run the base).
    """
    adapter, config = spec.adapter, spec.config
    with pinned_precision(spec.pin_precision):
        twins = build_twins(adapter, config, flax_params, spec.dtype, torch_params, spec.torch_device,
                            spec.jax_platform)
        twins.depths = spec.depths
        table = adapter.probe_table(twins)
        ref = adapter.flax_probes(twins, batch)
        test = adapter.torch_probes(twins, batch, ref if spec.mode == "isolated" else None)
        flips = adapter.rounding_flips(twins, ref, test)
        results = compare_probes(table, test, ref)
        gradients = gradient_parity(twins, batch) if spec.grads else None
        lora_gradients = None if lora is None else adapter.lora_gradients(twins, batch, lora)
        generation = adapter.generation(twins, batch, spec.generate, spec.suppress_tokens) if spec.generate else None
        env = environment(twins, seeds or {})
        env["precision"]["pinned"] = spec.pin_precision
    model = {"family": adapter.name, "config": config.to_dict(), **(model_info or {})}
    report = Report(mode=spec.mode, dtype=spec.dtype, num_params=count_params(flax_params), profile=spec.profile,
                    probes=results, inputs=batch.describe(config.pad_token_id), model=model, environment=env,
                    gradients=gradients, generation=generation, lora_gradients=lora_gradients, flips=flips)
    report = score(report, spec.profile)
    if spec.note:
        report.notes.append(spec.note)
    if spec.depths:
        report.notes.append(depth_note(report, spec.depths, ref, test))
    if spec.mode == "propagated" and report.first_divergence is not None:
        report.notes.append("propagated errors include drift from every earlier stage; --mode isolated feeds each "
                            "torch stage the Flax input and shows that stage's own error")
    return report


def run_parity(config: Any, flax_params: Mapping[str, Any], batch: Batch, *,
               torch_params: Mapping[str, Any] | None = None, lora: Any = None,
               model_info: Mapping[str, Any] | None = None, seeds: Mapping[str, Any] | None = None,
               **options: Any) -> Report:
    """`run` for a config of any family: its adapter looked up, `options` (RunSpec's, see `resolve`) resolved."""
    return run(resolve(adapter_of(config), config, **options), flax_params, batch, torch_params=torch_params,
               lora=lora, model_info=model_info, seeds=seeds)
