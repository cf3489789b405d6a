"""What a family declares so the parity engine, reports and CLI never name its layers: its `Adapter`.

Each family's `parity_tests/<family>/` folder builds one; `parity_tests.families` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Budgets:
    """One dtype's tolerance budgets for a family (parity_tests.tolerances.Budget each) and why they are what
    they are; `measured` holds the worst figures they were set from."""

    local: Any  # isolated mode: one stage's own error
    drift: Any  # propagated mode: error accumulated end to end
    grads_total: Any  # the whole gradient as one vector
    grads: Any | None  # each parameter's gradient (None: reported, not judged)
    why: str
    measured: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Adapter:
    family: str
    flax_model: Callable[[Any], Any]  # config -> the Flax twin (a linen module)
    torch_model: Callable[[Any, Any, str], Any]  # (Flax tree, config, dtype name) -> the torch twin
    probe_table: Callable[[Any], list]  # twins -> [probes.Probe] in execution order
    flax_probes: Callable[..., dict]  # (twins, batch) -> {probe: numpy}
    torch_probes: Callable[..., dict]  # (twins, batch, substitute | None) -> {probe: numpy}
    flax_loss_and_grads: Callable[..., tuple]  # (twins, batch) -> (loss, {flax path: gradient})
    torch_loss: Callable[..., Any]  # (twins, batch) -> scalar torch loss (autograd gives the gradients)
    generation: Callable[..., dict] | None  # (twins, batch, steps, suppress) -> generation section
    random_batch: Callable[..., Any]  # (config, batch, seed, **lengths) -> inputs.Batch
    token_file: Callable[..., Any]  # (path, config, seed, **lengths) -> inputs.Batch
    text_batch: Callable[..., Any]  # (tokenizer path, queries, tools, config, seed, **lengths) -> inputs.Batch
    budgets: Mapping[str, Budgets]  # compute dtype -> budgets
    lora_gradients: Callable[..., Any] | None = None  # (twins, batch, adapter) -> GradientResult of its A/B
    # (config, dtype, jax platform) -> (the config both twins run, a note for the report or None)
    prepare: Callable[[Any, str, str], tuple[Any, str | None]] | None = None
    special_ids: Sequence[int] = ()  # ids greedy decoding of a random model is kept off (it would stop at once)
    lengths: Mapping[str, int] = field(default_factory=dict)  # the random batch's default lengths by option
