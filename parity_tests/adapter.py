"""What a family declares so the parity engine, reports and CLI never name its layers: its `Adapter`.

Each family's `parity_tests/<family>/adapter.py` subclasses `Adapter`; `parity_tests.families`
lists one instance per family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from convert.errors import NeedleTwinError
from convert.family import Family


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
class GenerateRequest:
    """`needle-twin generate`'s options every family takes; a family's own come as a dict beside it."""

    tokens: str | None  # ids as typed, e.g. '2 391 385'
    query: str | None
    tools: str | None
    tokenizer: str | None  # a SentencePiece .model
    backend: str  # torch or flax
    max_new_tokens: int | None  # None: the family's upstream default
    dtype: str | None  # None: the checkpoint config's
    compile: bool


class Adapter(ABC):
    """One family's part of a parity run (twins, probes, loss, inputs, budgets) and of `needle-twin generate`."""

    family: Family  # convert's declaration: name, title, CLI options
    budgets: Mapping[str, Budgets]  # compute dtype -> budgets
    special_ids: Sequence[int] = ()  # ids greedy decoding of a random model is kept off (it would stop at once)

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def lengths(self) -> dict[str, int]:
        """The random batch's lengths by option name, with their defaults."""
        return {o.name: o.default for o in self.family.parity_options}

    @abstractmethod
    def flax_model(self, config: Any) -> Any:
        """The Flax twin (a linen module) of a config."""

    @abstractmethod
    def torch_model(self, tree: Mapping[str, Any], config: Any, dtype: str) -> Any:
        """The torch twin built from a Flax tree (numpy leaves) in `dtype`."""

    @abstractmethod
    def probe_table(self, twins) -> list:
        """The twins' probes (parity_tests.probes.Probe) in execution order."""

    @abstractmethod
    def flax_probes(self, twins, batch) -> dict:
        """{probe: numpy} from the Flax twin."""

    @abstractmethod
    def torch_probes(self, twins, batch, substitute: Mapping[str, Any] | None) -> dict:
        """{probe: numpy} from the torch twin; substitute: Flax values fed at each stage boundary (isolated mode)."""

    @abstractmethod
    def flax_loss_and_grads(self, twins, batch) -> tuple:
        """(loss, {flax path: gradient}) of upstream's training loss."""

    @abstractmethod
    def torch_loss(self, twins, batch) -> Any:
        """The same loss as a scalar torch tensor (autograd gives the gradients)."""

    @abstractmethod
    def random_batch(self, config: Any, batch: int, seed: int, **lengths: int) -> Any:
        """A seeded random inputs.Batch."""

    @abstractmethod
    def token_file(self, path: str, config: Any, seed: int, **lengths: int) -> Any:
        """An inputs.Batch from a token file."""

    @abstractmethod
    def text_batch(self, tokenizer: str, queries: Sequence[str], tools: str, config: Any, seed: int,
                   **lengths: int) -> Any:
        """An inputs.Batch from text through a SentencePiece model."""

    def prepare(self, config: Any, dtype: str, jax_platform: str) -> tuple[Any, str | None]:
        """(the config both twins run, a note for the report or None)."""
        return config, None

    def depths(self, config: Any, depth: str | None) -> tuple[int, ...]:
        """`--depth d|all` -> the depth rungs whose outputs the run compares too (families with a depth ladder)."""
        if depth is None:
            return ()
        raise NeedleTwinError(f"{self.family.title} has no depth ladder; drop --depth")

    def generation(self, twins, batch, steps: int, suppress: Sequence[int] | None) -> dict | None:
        """The report's greedy-generation section (None: the family has no decoder to compare)."""
        return None

    def rounding_flips(self, twins, ref: dict, test: dict) -> dict | None:
        """Rounding flips at the activation quantisers of the quant pass (parity_tests/flips.py), for families whose
        runs trace them: the report's `flips` section (the torch pass ran aligned to the reference's codes at each
        flip, so `test` is judged whole). None: no quant pass traced."""
        return None

    def lora_gradients(self, twins, batch, adapter: Any) -> Any:
        """A GradientResult of a LoRA adapter's A/B gradients."""
        raise NeedleTwinError(f"the {self.name} family has no LoRA adapters; drop --lora")

    def generate(self, checkpoint, request: GenerateRequest, options: Mapping[str, Any]) -> None:
        """`needle-twin generate`: decode from a loaded checkpoint, streaming to stdout; options: the family's own
        (`family.generate_options`), each None or False when not given."""
        raise NeedleTwinError(f"`needle-twin generate` does not run {self.family.title} yet")
