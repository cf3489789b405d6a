"""What `needle-twin parity` and `needle-twin rescore` do, minus argument parsing and printing.

Checks that need no model (option values, output paths) run first, so a usage error exits
before any checkpoint is read or model built, and nothing is written.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from convert.errors import ConfigError, ConfigMismatchError, NeedleTwinError
from convert.fields import DTYPES
from convert.io import read_checkpoint
from convert.mapping import random_flax_params
from convert.registry import FAMILIES, adapter_format, family_named
from parity_tests.adapter import Adapter
from parity_tests.devices import JAX_PLATFORMS
from parity_tests.engine import MODES, resolve, run
from parity_tests.families import adapter_named
from parity_tests.outputs import check_outputs, write_outputs
from parity_tests.report import Report, load_json, render_html, to_json
from parity_tests.report import rescore as rescore_report
from parity_tests.tolerances import device_class, get_profile, profile_by_name, with_overrides

EMBEDDED_MODEL_SEED = 0  # the embedded default: random_flax_params(<family>.published, seed=0)
DEFAULT_FAMILY = "v3"  # the family of the embedded default model (`--family`): Needle 3 at upstream's default size


@dataclass(frozen=True)
class Overrides:
    """CLI tolerance overrides (None = keep the profile's value)."""

    profile: str | None = None
    rtol: float | None = None
    atol: float | None = None
    kl_max: float | None = None
    grad_rtol: float | None = None

    def apply(self, base, budgets):
        profile = profile_by_name(budgets, self.profile) if self.profile else base
        return with_overrides(profile, rtol=self.rtol, atol=self.atol, kl_max=self.kl_max, grad_rtol=self.grad_rtol)


def check_choice(option: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise NeedleTwinError(f"{option} {value!r} is not one of {', '.join(choices)}")


def select_jax_platform(platform_name: str) -> None:
    """Pin JAX to CPU before its first import when asked for CPU: skips probing for accelerators."""
    if platform_name == "cpu" and "jax" not in sys.modules:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


@dataclass(frozen=True)
class ParityRequest:
    """`needle-twin parity` as the user asked it; `parity` checks and resolves it once."""

    flax_ckpt: str | None = None  # None: the embedded default model of `family`
    torch_ckpt: str | None = None
    family: str | None = None
    dtype: str = "float32"
    mode: str = "propagated"
    batch: int = 4
    lengths: Mapping[str, int | None] = field(default_factory=dict)  # the families' length options, as given
    seed: int = 0
    inputs: str | None = None
    tokenizer: str | None = None
    queries: Sequence[str] = ()
    tools: str = ""
    json_path: str | None = None
    html_path: str | None = None
    force: bool = False
    torch_device: str = "cpu"
    jax_platform: str = "cpu"
    pin_precision: bool = True
    grads: bool = True
    generate: int = 8
    # keep greedy generation off the family's special ids (v1's; Needle 2's decoding suppresses none); None = only
    # for the embedded random v1 model, whose tied output otherwise echoes the fed token (EOS) and stops at step 0
    suppress_special: bool | None = None
    overrides: Overrides = Overrides()
    depth: str | None = None  # `--depth d|all`: compare the twins at ladder rung d too, or at every rung
    lora: str | None = None  # an adapter file or PEFT directory for the checkpoint: its A/B gradients are compared


@dataclass(frozen=True)
class Models:
    """What a parity run compares: the family's adapter, its config, both trees and where they came from."""

    adapter: Adapter
    config: Any
    flax_params: Any
    torch_params: Any  # a torch checkpoint mapped to the Flax layout, or None (convert flax_params in memory)
    info: dict[str, Any]


def load_models(flax_ckpt: str | None, torch_ckpt: str | None, family: str | None = None) -> Models:
    """The run's models; family: the embedded default's (no checkpoint), a checkpoint's comes from the file."""
    if flax_ckpt is None:
        if torch_ckpt is not None:
            raise NeedleTwinError("--torch needs the Flax checkpoint it was converted from: "
                                  "needle-twin parity FLAX_CKPT --torch TORCH_CKPT")
        adapter = adapter_named(family or DEFAULT_FAMILY)
        kind = adapter.family
        config = kind.published
        info = {"source": f"embedded default: {kind.title}, random weights at the published size "
                          f"(seed {EMBEDDED_MODEL_SEED})",
                "flax_checkpoint": None, "torch_checkpoint": None, "seed": EMBEDDED_MODEL_SEED}
        return Models(adapter, config, random_flax_params(config, EMBEDDED_MODEL_SEED, groups=kind.groups), None, info)
    if family is not None:
        raise NeedleTwinError("--family chooses the embedded default model; a checkpoint's family is read from the "
                              "file: drop --family")
    flax = read_checkpoint(flax_ckpt)
    adapter = adapter_named(flax.family.name)
    info = {"flax_checkpoint": str(flax_ckpt), "flax_format": flax.format, "torch_checkpoint": None,
            "source": "checkpoint, converted to torch in memory"}
    if torch_ckpt is None:
        return Models(adapter, flax.config, flax.params, None, info)
    # A file without a config of its own takes the Flax one; one whose config differs is refused.
    try:
        other = read_checkpoint(torch_ckpt, flax.config)
    except ConfigMismatchError as e:  # stored: the torch file's; given: the Flax one's
        diff = "; ".join(f"{k}: {flax_v!r} vs {torch_v!r}" for k, (torch_v, flax_v) in e.fields.items())
        raise ConfigError(f"--torch {torch_ckpt} has a different config from {flax_ckpt} ({diff}); "
                          "compare checkpoints of the same model") from None
    info.update(torch_checkpoint=str(torch_ckpt), torch_format=other.format,
                source="two checkpoints: the torch file checked against the Flax one")
    return Models(adapter, flax.config, flax.params, other.params, info)


def make_batch(adapter: Adapter, config, request: ParityRequest):
    """The run's inputs: a token file, text through a tokenizer, or a seeded random batch (the family's)."""
    if request.inputs and request.tokenizer:
        raise NeedleTwinError("give either --inputs FILE or --tokenizer with --query, not both")
    if request.queries and not request.tokenizer:
        raise NeedleTwinError("--query needs --tokenizer MODEL (a SentencePiece model file)")
    given = {k: v for k, v in request.lengths.items() if v is not None}
    foreign = sorted(k for k in given if k not in adapter.lengths)
    if foreign:
        raise NeedleTwinError(f"{', '.join('--' + k.replace('_', '-') for k in foreign)} do not apply to "
                              f"{adapter.family.title} inputs; its lengths are "
                              f"{', '.join('--' + k.replace('_', '-') for k in adapter.lengths)}")
    sizes = {**adapter.lengths, **given}
    if request.tokenizer:
        return adapter.text_batch(request.tokenizer, request.queries, request.tools, config, seed=request.seed,
                                  **sizes)
    if request.inputs:
        return adapter.token_file(request.inputs, config, seed=request.seed, **sizes)
    return adapter.random_batch(config, batch=request.batch, seed=request.seed, **sizes)


def parity(request: ParityRequest) -> Report:
    """Load, run the engine, write the requested files; returns the judged report."""
    r = request
    check_choice("--dtype", r.dtype, DTYPES)
    check_choice("--mode", r.mode, MODES)
    check_choice("--jax-platform", r.jax_platform, JAX_PLATFORMS)
    if r.family is not None:
        check_choice("--family", r.family, tuple(FAMILIES))
    if r.generate < 0:
        raise NeedleTwinError(f"--generate must be >= 0, got {r.generate}")
    check_outputs((r.json_path, r.html_path), r.force)
    select_jax_platform(r.jax_platform)
    models = load_models(r.flax_ckpt, r.torch_ckpt, r.family)
    adapter, config = models.adapter, models.config
    info = dict(models.info)
    lora_adapter = None
    if r.lora is not None:
        kind = adapter_format(r.lora)
        if kind is None:
            raise NeedleTwinError(f"--lora {r.lora}: not a LoRA adapter (an upstream adapter pickle or a PEFT "
                                  "directory)")
        if kind.family != adapter.name:
            raise NeedleTwinError(f"--lora {r.lora} is a {family_named(kind.family).title} adapter; the model is "
                                  f"{adapter.family.title}")
        lora_adapter = kind.read(r.lora)
        kind.check(lora_adapter, models.flax_params, config)
        info["lora"] = str(r.lora)
    profile = r.overrides.apply(get_profile(adapter.budgets, r.dtype, device_class(r.torch_device, r.jax_platform)),
                                adapter.budgets)
    if profile.dtype != r.dtype:
        raise NeedleTwinError(f"--profile {profile.name} is for {profile.dtype}, but --dtype is {r.dtype}; "
                              f"pick a {r.dtype} profile or change --dtype")
    data = make_batch(adapter, config, r)
    seeds: dict[str, Any] = {"inputs": r.seed}
    if r.flax_ckpt is None:
        seeds["model"] = EMBEDDED_MODEL_SEED
    suppress_special = r.suppress_special
    if suppress_special is None:
        suppress_special = r.flax_ckpt is None and bool(adapter.special_ids)
    elif suppress_special and not adapter.special_ids:
        raise NeedleTwinError(f"--suppress-special: {adapter.family.title} decoding suppresses no ids "
                              "(upstream's has none); drop it")
    spec = resolve(adapter, config, dtype=r.dtype, mode=r.mode, profile=profile, torch_device=r.torch_device,
                   jax_platform=r.jax_platform, pin_precision=r.pin_precision, grads=r.grads, generate=r.generate,
                   suppress_tokens=adapter.special_ids if suppress_special else None, depth=r.depth)
    report = run(spec, models.flax_params, data, torch_params=models.torch_params, lora=lora_adapter,
                 model_info=info, seeds=seeds)
    write_outputs(report, ((r.json_path, to_json), (r.html_path, render_html)), r.force)
    return report


def rescore(report_path: str, *, json_path: str | None = None, html_path: str | None = None, force: bool = False,
            overrides: Overrides = Overrides()) -> Report:
    """Re-judge a saved JSON report against another profile or overridden budgets; no model runs."""
    check_outputs((json_path, html_path), force)
    old = load_json(report_path)
    family = old.model.get("family", "v1")  # reports from before families were Needle v1's
    new = rescore_report(old, overrides.apply(old.profile, adapter_named(family).budgets))
    if new.profile.dtype != old.dtype:
        raise NeedleTwinError(f"profile {new.profile.name} is for {new.profile.dtype}, but the report was computed "
                              f"in {old.dtype}; pick a {old.dtype} profile")
    write_outputs(new, ((json_path, to_json), (html_path, render_html)), force)
    return new
