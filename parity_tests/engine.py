"""The parity engine: run both twins on the same weights and inputs, compare every probe, return a Report.

Shared by the pytest suite and `needle-twin parity`. Both twins compute in the profile's
dtype: the Flax tree is cast once (as upstream does for bf16 inference) and the torch
twin is built from the same cast arrays, so the weights are bit-identical.

Modes:
  propagated  both twins run end to end; each probe's error includes drift from upstream stages.
  isolated    the torch run is fed the Flax value at every stage boundary (embeddings, block
              outputs, final norms), so each probe's error is local to its stage.
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from convert.config import TransformerConfig
from convert.errors import NeedleTwinError
from convert.mapping import flatten_tree, np_dtype
from parity_tests import metrics, probes
from parity_tests.inputs import Batch
from parity_tests.report import ProbeResult, Report, score
from parity_tests.tolerances import Profile, device_class, get_profile

MODES = ("propagated", "isolated")
TORCH_DEVICES = ("cpu", "cuda", "mps")
JAX_PLATFORMS = ("cpu", "gpu", "tpu")


class DeviceError(NeedleTwinError, RuntimeError):
    """A requested device is not available to this install."""


# ----------------------------------------------------------------------------- precision and devices


@contextmanager
def pinned_precision(enabled: bool = True) -> Iterator[None]:
    """Full float32 matmuls in both libraries (no TF32, no bf16 passes, no reduced-precision reductions).

    Restores the previous settings on exit, so library users keep their own configuration.
    """
    import jax
    import torch

    cuda = torch.backends.cuda.matmul
    saved = (jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision(), cuda.allow_tf32,
             torch.backends.cudnn.allow_tf32, cuda.allow_fp16_reduced_precision_reduction,
             cuda.allow_bf16_reduced_precision_reduction)
    if enabled:
        jax.config.update("jax_default_matmul_precision", "highest")
        torch.set_float32_matmul_precision("highest")
        cuda.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        cuda.allow_fp16_reduced_precision_reduction = cuda.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", saved[0])
        torch.set_float32_matmul_precision(saved[1])
        cuda.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]
        cuda.allow_fp16_reduced_precision_reduction, cuda.allow_bf16_reduced_precision_reduction = saved[4:]


def precision_settings() -> dict[str, Any]:
    """The settings in force now, as recorded in every report."""
    import jax
    import torch

    cuda = torch.backends.cuda.matmul
    return {
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
        "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_cuda_matmul_allow_tf32": cuda.allow_tf32,
        "torch_cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch_allow_fp16_reduced_precision_reduction": cuda.allow_fp16_reduced_precision_reduction,
        "torch_allow_bf16_reduced_precision_reduction": cuda.allow_bf16_reduced_precision_reduction,
    }


def torch_device(name: str):
    """torch.device for cpu / cuda[:N] / mps, or a DeviceError saying what this install has."""
    import torch

    kind, _, index = name.partition(":")
    if kind not in TORCH_DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise DeviceError(f"--torch-device {name!r} is not one of cpu, cuda, cuda:N, mps")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--torch-device {name}: this torch ({torch.__version__}) sees no CUDA device; "
                              "use --torch-device cpu or install a CUDA build of torch")
        if index and int(index) >= torch.cuda.device_count():
            raise DeviceError(f"--torch-device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("--torch-device mps: MPS is not available (needs Apple silicon and a macOS torch build); "
                          "use --torch-device cpu")
    return torch.device(name)


def jax_device(platform_name: str):
    """The first JAX device of a platform (cpu, gpu, tpu), or a DeviceError listing what JAX sees."""
    import jax

    if platform_name not in JAX_PLATFORMS:
        raise DeviceError(f"--jax-platform {platform_name!r} is not one of {', '.join(JAX_PLATFORMS)}")
    try:
        return jax.devices(platform_name)[0]
    except RuntimeError:
        seen = sorted({d.platform for d in jax.devices()})
        raise DeviceError(f"--jax-platform {platform_name}: JAX sees no {platform_name} device (it sees "
                          f"{', '.join(seen)}); use --jax-platform {seen[0]} or install jax with "
                          f"{platform_name} support") from None


# ----------------------------------------------------------------------------- twins


@dataclass
class Twins:
    """Both models on their devices, with bit-identical weights in the compute dtype."""

    config: TransformerConfig  # dtype = compute dtype
    flax_model: Any
    flax_params: Any  # jax arrays on jax_device
    torch_model: Any
    jax_device: Any
    torch_device: Any


def cast_tree(params: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """A copy of a nested numpy tree in `dtype` (upstream casts every leaf for bf16 inference): the twins own it."""
    target = np_dtype(dtype)
    return {k: cast_tree(v, dtype) if isinstance(v, Mapping) else np.array(v, dtype=target)
            for k, v in params.items()}


def build_twins(config: TransformerConfig, flax_params: Mapping[str, Any], dtype: str,
                torch_params: Mapping[str, Any] | None = None, torch_device_name: str = "cpu",
                jax_platform: str = "cpu") -> Twins:
    """Flax twin from `flax_params`, torch twin from `torch_params` (default: the same tree), both in `dtype`."""
    import jax

    import needle_flax
    import needle_torch

    tdev, jdev = torch_device(torch_device_name), jax_device(jax_platform)
    cfg = config.replace(dtype=dtype)
    flax_tree = cast_tree(flax_params, dtype)
    torch_tree = flax_tree if torch_params is None else cast_tree(torch_params, dtype)
    tmodel = needle_torch.SimpleAttentionNetwork.from_flax(torch_tree, cfg, dtype).to(tdev).eval()
    params = jax.device_put(flax_tree, jdev)
    return Twins(cfg, needle_flax.SimpleAttentionNetwork(cfg), params, tmodel, jdev, tdev)


@functools.lru_cache(maxsize=8)
def _flax_forward(config: TransformerConfig):
    """jit(params, src, tgt) -> (text-pass intermediates, contrastive-pass intermediates); one per config."""
    import jax

    from needle_flax import PROBES, SimpleAttentionNetwork, make_causal_mask, make_padding_mask

    model, pad = SimpleAttentionNetwork(config), config.pad_token_id

    def run(params, src, tgt):
        src_mask = make_padding_mask(src, pad)
        tgt_mask = make_causal_mask(tgt.shape[1]) & make_padding_mask(tgt, pad)
        _, text = model.apply({"params": params}, src, tgt, src_mask, tgt_mask, src_mask, mutable=[PROBES])
        _, contrastive = model.apply({"params": params}, src, method="encode_contrastive", mutable=[PROBES])
        return text[PROBES], contrastive[PROBES]

    return jax.jit(run)


def flax_run(twins: Twins, batch: Batch) -> dict[str, np.ndarray]:
    """Every probe of the Flax twin: one jitted text pass plus the contrastive pass."""
    import jax

    src, tgt = (jax.device_put(a, twins.jax_device) for a in (batch.src, batch.tgt))
    text, contrastive = jax.device_get(_flax_forward(twins.config)(twins.flax_params, src, tgt))
    return probes.flax_probes(probes.probe_table(twins.config), text, contrastive)


def torch_tensor(a: np.ndarray, device):
    """numpy (bf16 included) -> torch tensor on `device`."""
    from convert.mapping import numpy_to_torch

    return numpy_to_torch(a).to(device)  # copies read-only arrays (e.g. from jax.device_get)


def torch_run(twins: Twins, batch: Batch, substitute: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every probe of the torch twin; with `substitute`, boundary outputs are replaced by those values."""
    import torch

    from needle_torch import make_causal_mask, make_padding_mask

    model, dev, pad = twins.torch_model, twins.torch_device, twins.config.pad_token_id
    table = probes.probe_table(twins.config)
    subs = None if substitute is None else {p.name: torch_tensor(substitute[p.name], dev) for p in table if p.boundary}
    src, tgt = (torch.from_numpy(a).long().to(dev) for a in (batch.src, batch.tgt))
    src_mask = make_padding_mask(src, pad)
    tgt_mask = make_causal_mask(tgt.shape[1], dev) & make_padding_mask(tgt, pad)
    with torch.inference_mode(), probes.torch_capture(model, table, subs) as captured:
        model(src, tgt, src_mask, tgt_mask, src_mask)
        model.encode_contrastive(src)
    return {name: t.float().cpu().numpy() for name, t in captured.items()}


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
    import torch

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


def run_parity(config: TransformerConfig, flax_params: Mapping[str, Any], batch: Batch, *,
               torch_params: Mapping[str, Any] | None = None, dtype: str = "float32", mode: str = "propagated",
               profile: Profile | None = None, torch_device_name: str = "cpu", jax_platform: str = "cpu",
               pin_precision: bool = True, grads: bool = False, generate: int = 0,
               suppress_tokens: Sequence[int] | None = None, model_info: Mapping[str, Any] | None = None,
               seeds: Mapping[str, Any] | None = None) -> Report:
    """Compare the twins probe by probe (and optionally gradients and greedy generation); a judged Report.

    flax_params / torch_params: nested upstream Flax trees of numpy arrays (torch_params: a torch
    checkpoint already mapped to the Flax layout; None = convert flax_params in memory).
    generate: greedy steps to compare (0 = none); suppress_tokens: ids greedy decoding may not pick.
    """
    if mode not in MODES:
        raise NeedleTwinError(f"--mode {mode!r} is not one of {', '.join(MODES)}")
    profile = profile or get_profile(dtype, device_class(torch_device_name, jax_platform))
    if profile.dtype != dtype:
        raise NeedleTwinError(f"tolerance profile {profile.name} is for {profile.dtype}, but the run computes in "
                              f"{dtype}; pick the {dtype} profile or drop --profile")
    with pinned_precision(pin_precision):
        twins = build_twins(config, flax_params, dtype, torch_params, torch_device_name, jax_platform)
        table = probes.probe_table(twins.config)
        ref = flax_run(twins, batch)
        test = torch_run(twins, batch, substitute=ref if mode == "isolated" else None)
        results = compare_probes(table, test, ref)
        gradients = None
        if grads:
            from parity_tests.gradients import gradient_parity

            gradients = gradient_parity(twins, batch)
        generation = generation_section(twins, batch, generate, suppress_tokens) if generate else None
        env = environment(twins, seeds or {})
        env["precision"]["pinned"] = pin_precision
    model = {"config": config.to_dict(), **(model_info or {})}
    report = Report(mode=mode, dtype=dtype, num_params=count_params(flax_params), profile=profile, probes=results,
                    inputs=batch.describe(config.pad_token_id), model=model, environment=env, gradients=gradients,
                    generation=generation)
    report = score(report, profile)
    if mode == "propagated" and report.first_divergence is not None:
        report.notes.append("propagated errors include drift from every earlier stage; --mode isolated feeds each "
                            "torch stage the Flax input and shows that stage's own error")
    return report


def generation_section(twins: Twins, batch: Batch, max_new_tokens: int,
                       suppress_tokens: Sequence[int] | None = None) -> dict[str, Any]:
    """Greedy generation parity (parity_tests.generation): both twins decode with their caches from EOS."""
    from needle_flax import make_padding_mask
    from parity_tests.generation import generation_parity

    src_mask = np.asarray(make_padding_mask(batch.src, twins.config.pad_token_id))
    return generation_parity(twins.flax_model, twins.flax_params, twins.torch_model, batch.src, src_mask,
                             max_new_tokens, suppress_tokens)
