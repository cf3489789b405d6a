"""The Flax <-> torch mapping rules: one declarative table per family, read the same way in both directions.

Each rule names a Flax path, a torch name, the per-layer Flax shape (in the family's size
symbols) and whether the array is transposed (Dense kernels are (in, out); torch Linear
weights are (out, in)). A rule under a scanned stack names its layer-count symbol in
`stack` and carries `{i}` in the torch name: the Flax array has a leading layer axis, torch
one tensor per layer. Rules only rename, transpose and (un)stack, never do arithmetic, so
Flax -> torch -> Flax is bit-exact by construction in every dtype.

A `ParamTable` is one family's rules for one config and one set of optional groups (a
group, such as Needle 2's MTP head, is in a checkpoint as a whole or not at all). Every
layout question is answered by it: names, shapes, parameter counts, the docs table. The
one engine that applies it to tensors, in memory or read lazily from a file, is
`convert.plan`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

FLAX, TORCH = "flax", "torch"  # layouts: upstream nested-tree paths ("a/b/c") or torch state_dict names


@dataclass(frozen=True)
class Rule:
    flax: str  # path in the Flax param tree, "/"-joined
    torch: str  # state_dict key; "{i}" = layer index when stacked
    shape: tuple[str, ...]  # per-layer Flax shape in the family's size symbols
    transpose: bool = False  # Dense kernel (in, out) <-> Linear weight (out, in)
    stack: str | None = None  # layer-count symbol when scanned: leading layer axis in Flax, one tensor a layer in torch
    group: str | None = None  # optional group the tensor belongs to (None: always there)


@dataclass(frozen=True)
class ParamTable:
    """A family's rules for one config and one set of present optional groups."""

    rules: tuple[Rule, ...]
    dims: Mapping[str, int]
    stack_names: Mapping[str, tuple[str, str]]  # layer-count symbol -> (what is stacked, the config field counting it)

    def layers(self, rule: Rule) -> int | None:
        return None if rule.stack is None else self.dims[rule.stack]

    def flax_shape(self, rule: Rule) -> tuple[int, ...]:
        per_layer = tuple(self.dims[s] for s in rule.shape)
        n = self.layers(rule)
        return per_layer if n is None else (n, *per_layer)

    def torch_shape(self, rule: Rule) -> tuple[int, ...]:
        per_layer = tuple(self.dims[s] for s in rule.shape)
        return per_layer[::-1] if rule.transpose else per_layer

    def torch_names(self, rule: Rule) -> list[str]:
        n = self.layers(rule)
        return [rule.torch] if n is None else [rule.torch.format(i=i) for i in range(n)]

    def names(self, layout: str) -> list[str]:
        return [rule.flax for rule in self.rules] if layout == FLAX else \
            [name for rule in self.rules for name in self.torch_names(rule)]

    def expected(self, layout: str) -> dict[str, tuple[int, ...]]:
        """{name: shape} of every tensor in that layout."""
        if layout == FLAX:
            return {r.flax: self.flax_shape(r) for r in self.rules}
        return {name: self.torch_shape(r) for r in self.rules for name in self.torch_names(r)}

    def rule_of(self, layout: str) -> dict[str, tuple[Rule, int | None]]:
        """{name: (rule, layer index or None)} in that layout."""
        if layout == FLAX:
            return {r.flax: (r, None) for r in self.rules}
        return {name: (r, i if r.stack else None) for r in self.rules for i, name in enumerate(self.torch_names(r))}

    def num_parameters(self) -> int:
        return sum(math.prod(self.flax_shape(r)) for r in self.rules)


def entry_problems(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The missing, unexpected and mis-shaped entries, one phrase per kind (empty when all match)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(k for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {', '.join(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected)}")
    if misshaped:
        parts.append("wrong shape: " + ", ".join(
            f"{k} is {tuple(found[k])}, expected {tuple(expected[k])}" for k in misshaped))
    return parts


def pattern(name: str) -> str:
    """A tensor name with every layer/site index replaced by '#': the same for any config of a family."""
    out, digits = [], False
    for ch in name:
        if ch.isdigit():
            if not digits:
                out.append("#")
            digits = True
        else:
            out.append(ch)
            digits = False
    return "".join(out)


def markdown(tables: Iterable[tuple[str, ParamTable, Mapping[str, str]]]) -> str:
    """The mapping as markdown, one section per family: (title, table, {size symbol: meaning})."""
    lines = ["# Flax <-> torch parameter mapping", "",
             "Generated from each family's rules (`convert.registry.mapping_markdown()`); a test keeps it in step. "
             "Every rule only renames, transposes and (un)stacks, so conversions are bit-exact both ways.", ""]
    for title, table, symbols in tables:
        lines += [f"## {title}", "", "Sizes: " + "; ".join(f"{k} = {v}" for k, v in symbols.items()) + ".", "",
                  "| torch name | Flax path | per-layer Flax shape | layout |", "|---|---|---|---|"]
        for r in table.rules:
            parts = ["transposed"] if r.transpose else []
            parts += [f"stacked on axis 0 over {table.stack_names[r.stack][0]} layers"] if r.stack else []
            parts += [f"optional group `{r.group}`"] if r.group else []
            shape = "(" + ", ".join(r.shape) + (",)" if len(r.shape) == 1 else ")")
            lines.append(f"| `{r.torch}` | `{r.flax}` | {shape} | {'; '.join(parts) or 'as is'} |")
        lines.append("")
    return "\n".join(lines)
