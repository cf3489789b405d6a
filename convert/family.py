"""What a model family declares so that shared code (io, planner, formats, CLI) never names its layers.

A family is a folder in each package (`convert/v2/`, `needle_flax/v2/`, `needle_torch/v2/`,
`parity_tests/v2/`); here it declares the framework-free part: its name (recorded in every
file we write), its config class, its mapping rules and size symbols, its optional groups
and how its upstream pickle looks. `convert.registry` lists the families.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from convert.fields import FamilyConfig
from convert.rules import FLAX, ParamTable, Rule, pattern
from convert.source import Source


@dataclass(frozen=True)
class CliOption:
    """An option a family adds to a CLI command (`--kv-window` for keyword `kv_window`); framework-free, so the CLI
    builds its commands from the registry without importing a model."""

    name: str  # the command's keyword; the flag is --name with dashes
    type: type  # int, float, str or bool (a bool is a flag)
    help: str
    default: Any = None  # the family's value when the option is not given (said in the help)
    min: float | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Family:
    name: str  # "v1", "v2": the `family` entry of our safetensors metadata and config.json
    title: str
    config_cls: type[FamilyConfig]
    rules: Callable[[Any], list[Rule]]  # every rule of a config, optional groups included, in file order
    dims: Callable[[Any], dict[str, int]]  # size symbols of a config
    stack_names: Mapping[str, tuple[str, str]]  # layer-count symbol -> (what is stacked, its config field)
    symbols: Mapping[str, str]  # every size symbol of the rules -> its meaning, for docs
    published: FamilyConfig  # the published model's config (the default parity job's size)
    docs_config: FamilyConfig  # a config that has every rule (docs/MAPPING.md, detection patterns)
    groups: tuple[str, ...] = ()  # optional groups: present in a checkpoint as a whole or not at all
    default_groups: tuple[str, ...] = ()  # the groups upstream's plain `init` creates
    pickle_version: int | None = None  # upstream pickle's `format_version` (None: the file has none)
    pickle_keys: tuple[str, ...] = ("params", "config")  # top-level keys upstream's pickle may hold
    safetensors_version: str | None = None  # upstream's own safetensors checkpoint's `format_version` (Needle 3)
    # Sub-models as files (Needle 3's ladder): (params, config, n) -> (params, config) of depth rung n / width n.
    rung: Callable[[Any, Any, int], tuple[Any, Any]] | None = None
    halve: Callable[[Any, Any, int], tuple[Any, Any]] | None = None
    # Extra words for a config mismatch: (tensor names, config) -> a hint naming the field, or None.
    hint: Callable[[set[str], Any], str | None] | None = None
    parity_options: tuple[CliOption, ...] = ()  # `parity`'s random-batch lengths (their defaults: the batch's)
    generate_options: tuple[CliOption, ...] = ()  # `generate` options only this family's decoding takes
    # CLI commands a family runs itself, as "module:function" (imported only when run, so the registry stays free of
    # torch and jax): "generate" (checkpoint, request, options, runner) and "embed" (checkpoint, request, runner).
    commands: Mapping[str, str] = field(default_factory=dict)
    # The twins' runners those commands drive, per backend ("torch", "flax"), as "module:class" (params, config).
    runners: Mapping[str, str] = field(default_factory=dict)
    _patterns: dict = field(default_factory=dict, compare=False, repr=False)

    def table(self, config: Any, groups: Iterable[str] | None = None) -> ParamTable:
        """The rules of `config` with these optional groups (None: all of them)."""
        keep = set(self.groups if groups is None else groups)
        unknown = keep - set(self.groups)
        if unknown:
            raise ValueError(f"{self.title} has no optional group(s) {sorted(unknown)}; it has {list(self.groups)}")
        rules = tuple(r for r in self.rules(config) if r.group is None or r.group in keep)
        return ParamTable(rules, self.dims(config), self.stack_names)

    def groups_in(self, names: Iterable[str], layout: str, config: Any) -> tuple[str, ...]:
        """The optional groups any of whose tensors are among `names` (in the family's group order)."""
        full = self.table(config)
        owner = {name: rule.group for name, (rule, _) in full.rule_of(layout).items()}
        seen = {owner.get(name) for name in names}
        return tuple(g for g in self.groups if g in seen)

    def table_for(self, names: Iterable[str], layout: str, config: Any) -> ParamTable:
        """The table a checkpoint holding `names` should match: required rules plus the groups it has."""
        names = list(names)
        return self.table(config, self.groups_in(names, layout, config))

    def count_parameters(self, config: Any, groups: Iterable[str] | None = None) -> int:
        """Parameters of a model of this config, from the rules; groups default to upstream's plain init."""
        return self.table(config, self.default_groups if groups is None else groups).num_parameters()

    def patterns(self, layout: str) -> set[str]:
        """Tensor names of this family with indices replaced by '#' (recognising a checkpoint by its names)."""
        if layout not in self._patterns:
            self._patterns[layout] = {pattern(n) for n in self.table(self.docs_config).names(layout)}
        return self._patterns[layout]

    def config_from_dict(self, d: Mapping[str, Any]) -> FamilyConfig:
        return self.config_cls.from_dict(d)


@dataclass(frozen=True)
class FileFormat:
    """A format a family owns (Needle 2's `.cact`), recognised, read and written through the same io front door."""

    name: str  # the format's name in messages and `inspect` ("cact")
    family: str
    extensions: tuple[str, ...]
    sniff: Callable[[bytes], bool]  # from the first 16 bytes of a file
    read: Callable[[Path], Source]  # -> the family's Flax tree as a Source, with its config dict
    write: Callable[..., None] | None  # (params, config, tmp path, **options) -> None
    options: tuple[str, ...] = ()  # write options the CLI passes through (e.g. bits, tokenizer)
    lossy: str = ""  # what is lost reading it back, said whenever it is converted
    describe: Callable[[Path], dict] | None = None  # `inspect`'s extras: {"lint": [problems], ...}, never raises


@dataclass(frozen=True)
class AdapterFormat:
    """Fine-tuning adapters a family reads and writes (Needle 2's LoRA: upstream's pickle, PEFT directories).

    An adapter is not a checkpoint: converting one needs its base (`needle-twin convert ADAPTER DST --base BASE`)."""

    name: str
    family: str
    recognise: Callable[[Path], bool]  # from the file's content (never from its name alone)
    read: Callable[..., Any]  # (path, allow_untrained=False) -> the adapter
    describe: Callable[[Any], dict]  # -> `inspect`'s dict
    check: Callable[[Any, Any, Any], None]  # (adapter, base params, base config): raises naming the mismatch
    merge: Callable[[Any, Any], Any]  # (adapter, base params) -> merged params (upstream's rule)
    write: Callable[..., Path]  # (adapter, config, dst, base=path-or-None, force=False) -> the written path


__all__ = ["FLAX", "AdapterFormat", "CliOption", "Family", "FileFormat"]
