"""What `needle-twin parity` and `needle-twin rescore` do, minus argument parsing and printing.

Checks that need no model (option values, output paths) run first, so a usage error exits
before any checkpoint is read or model built, and nothing is written.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from convert.errors import ConfigError, ConfigMismatchError, NeedleTwinError
from convert.fields import DTYPES
from convert.io import read_checkpoint
from convert.mapping import random_flax_params
from convert.registry import FAMILIES, adapter_format, family_named
from parity_tests.adapter import Adapter
from parity_tests.devices import JAX_PLATFORMS
from parity_tests.engine import MODES, run_parity
from parity_tests.families import adapter_named, adapter_of
from parity_tests.outputs import check_outputs, write_outputs
from parity_tests.report import Report, load_json, render_html, to_json
from parity_tests.report import rescore as rescore_report
from parity_tests.tolerances import device_class, get_profile, profile_by_name, with_overrides

EMBEDDED_MODEL_SEED = 0  # the embedded default: random_flax_params(<family>.published, seed=0)
DEFAULT_FAMILY = "v2"  # the family of the embedded default model (`--family`): Needle 2, what users download


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


def load_models(flax_ckpt: str | None, torch_ckpt: str | None, family: str | None = None):
    """(config, Flax params, torch params mapped to the Flax layout or None, model info for the report).

    family: the embedded default's family (no checkpoint); a checkpoint's family comes from the file."""
    if flax_ckpt is None:
        if torch_ckpt is not None:
            raise NeedleTwinError("--torch needs the Flax checkpoint it was converted from: "
                                  "needle-twin parity FLAX_CKPT --torch TORCH_CKPT")
        kind = family_named(family or DEFAULT_FAMILY)
        config = kind.published
        info = {"source": f"embedded default: {kind.title}, random weights at the published size "
                          f"(seed {EMBEDDED_MODEL_SEED})",
                "flax_checkpoint": None, "torch_checkpoint": None, "seed": EMBEDDED_MODEL_SEED}
        return config, random_flax_params(config, EMBEDDED_MODEL_SEED, groups=kind.groups), None, info
    if family is not None:
        raise NeedleTwinError("--family chooses the embedded default model; a checkpoint's family is read from the "
                              "file: drop --family")
    flax = read_checkpoint(flax_ckpt)
    info = {"flax_checkpoint": str(flax_ckpt), "flax_format": flax.format, "torch_checkpoint": None,
            "source": "checkpoint, converted to torch in memory"}
    if torch_ckpt is None:
        return flax.config, flax.params, None, info
    # A file without a config of its own takes the Flax one; one whose config differs is refused.
    try:
        other = read_checkpoint(torch_ckpt, flax.config)
    except ConfigMismatchError as e:  # stored: the torch file's; given: the Flax one's
        diff = "; ".join(f"{k}: {flax_v!r} vs {torch_v!r}" for k, (torch_v, flax_v) in e.fields.items())
        raise ConfigError(f"--torch {torch_ckpt} has a different config from {flax_ckpt} ({diff}); "
                          "compare checkpoints of the same model") from None
    info.update(torch_checkpoint=str(torch_ckpt), torch_format=other.format,
                source="two checkpoints: the torch file checked against the Flax one")
    return flax.config, flax.params, other.params, info


def make_batch(adapter: Adapter, config, *, inputs: str | None, tokenizer: str | None, queries: Sequence[str],
               tools: str, batch: int, seed: int, lengths: dict[str, int | None]):
    """The run's inputs: a token file, text through a tokenizer, or a seeded random batch (the family's)."""
    if inputs and tokenizer:
        raise NeedleTwinError("give either --inputs FILE or --tokenizer with --query, not both")
    if queries and not tokenizer:
        raise NeedleTwinError("--query needs --tokenizer MODEL (a SentencePiece model file)")
    foreign = sorted(k for k, v in lengths.items() if v is not None and k not in adapter.lengths)
    if foreign:
        raise NeedleTwinError(f"{', '.join('--' + k.replace('_', '-') for k in foreign)} do not apply to "
                              f"{family_named(adapter.family).title} inputs; its lengths are "
                              f"{', '.join('--' + k.replace('_', '-') for k in adapter.lengths)}")
    sizes = {k: (v if lengths.get(k) is None else lengths[k]) for k, v in adapter.lengths.items()}
    if tokenizer:
        return adapter.text_batch(tokenizer, queries, tools, config, seed=seed, **sizes)
    if inputs:
        return adapter.token_file(inputs, config, seed=seed, **sizes)
    return adapter.random_batch(config, batch=batch, seed=seed, **sizes)


def parity(flax_ckpt: str | None = None, *, torch_ckpt: str | None = None, family: str | None = None,
           dtype: str = "float32", mode: str = "propagated", batch: int = 4, src_len: int | None = None,
           tgt_len: int | None = None, seq_len: int | None = None, seed: int = 0, inputs: str | None = None,
           tokenizer: str | None = None, queries: Sequence[str] = (), tools: str = "", json_path: str | None = None,
           html_path: str | None = None, force: bool = False, torch_device: str = "cpu", jax_platform: str = "cpu",
           pin_precision: bool = True, grads: bool = True, generate: int = 8, suppress_special: bool | None = None,
           overrides: Overrides = Overrides(), lora: str | None = None) -> Report:
    """Load, run the engine, write the requested files; returns the judged report.

    Defaults are the CLI's (gradients on, 8 greedy steps). suppress_special: keep greedy generation off the
    family's special ids (v1's; Needle 2's decoding suppresses none); None = only for the embedded random v1 model,
    whose tied output otherwise echoes the fed token (EOS) and stops at step 0. lora: an adapter file or PEFT
    directory for the checkpoint: its A/B gradients (Flax: upstream's merge inside the loss; torch: PEFT) are
    compared too.
    """
    check_choice("--dtype", dtype, DTYPES)
    check_choice("--mode", mode, MODES)
    check_choice("--jax-platform", jax_platform, JAX_PLATFORMS)
    if family is not None:
        check_choice("--family", family, tuple(FAMILIES))
    if generate < 0:
        raise NeedleTwinError(f"--generate must be >= 0, got {generate}")
    check_outputs((json_path, html_path), force)
    select_jax_platform(jax_platform)
    config, flax_params, torch_params, info = load_models(flax_ckpt, torch_ckpt, family)
    adapter = adapter_of(config)
    lora_adapter = None
    if lora is not None:
        kind = adapter_format(lora)
        if kind is None:
            raise NeedleTwinError(f"--lora {lora}: not a LoRA adapter (an upstream adapter pickle or a PEFT directory)")
        if kind.family != adapter.family:
            raise NeedleTwinError(f"--lora {lora} is a {family_named(kind.family).title} adapter; the model is "
                                  f"{family_named(adapter.family).title}")
        lora_adapter = kind.read(lora)
        kind.check(lora_adapter, flax_params, config)
        info["lora"] = str(lora)
    profile = overrides.apply(get_profile(adapter.budgets, dtype, device_class(torch_device, jax_platform)),
                              adapter.budgets)
    if profile.dtype != dtype:
        raise NeedleTwinError(f"--profile {profile.name} is for {profile.dtype}, but --dtype is {dtype}; "
                              f"pick a {dtype} profile or change --dtype")
    data = make_batch(adapter, config, inputs=inputs, tokenizer=tokenizer, queries=queries, tools=tools,
                      batch=batch, seed=seed, lengths={"src_len": src_len, "tgt_len": tgt_len, "seq_len": seq_len})
    seeds: dict[str, Any] = {"inputs": seed}
    if flax_ckpt is None:
        seeds["model"] = EMBEDDED_MODEL_SEED
    if suppress_special is None:
        suppress_special = flax_ckpt is None and bool(adapter.special_ids)
    elif suppress_special and not adapter.special_ids:
        raise NeedleTwinError(f"--suppress-special: {family_named(adapter.family).title} decoding suppresses no ids "
                              "(upstream's has none); drop it")
    report = run_parity(config, flax_params, data, torch_params=torch_params, dtype=dtype, mode=mode,
                        profile=profile, torch_device_name=torch_device, jax_platform=jax_platform,
                        pin_precision=pin_precision, grads=grads, generate=generate,
                        suppress_tokens=adapter.special_ids if suppress_special else None, model_info=info,
                        seeds=seeds, lora=lora_adapter)
    write_outputs(report, ((json_path, to_json), (html_path, render_html)), force)
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
