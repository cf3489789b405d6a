"""What every family's config shares: a frozen dataclass built from upstream's partial dicts, checked field by field.

Framework-free on purpose: importing it pulls in neither torch nor jax. A family's config
subclasses `FamilyConfig`, declares upstream's fields with upstream's defaults, and checks
its own invariants in `check()`; values from pickles (numpy scalars, lists for tuples) are
coerced here, and a wrong kind of value is named with its field.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from typing import Any, ClassVar

from convert.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class FamilyConfig:
    """Base of each family's config dataclass (subclasses are frozen dataclasses too)."""

    # Keys upstream's class no longer knows are kept here by families that allow them (see `keeps_unknown`).
    family: ClassVar[str] = ""
    keeps_unknown: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for f in self.fields():
            object.__setattr__(self, f.name, coerce(f.name, f.type, getattr(self, f.name)))
        self.check()

    def check(self) -> None:
        """Raise ConfigError naming the field and the fix; subclasses add their invariants."""
        if self.dtype not in DTYPES:  # type: ignore[attr-defined]
            raise ConfigError(f"config.dtype={self.dtype!r} is unknown; use one of {', '.join(DTYPES)}")

    @classmethod
    def fields(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.name != "extras"]

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in cls.fields()]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        """Build from a (possibly partial) upstream config dict; missing fields take upstream's defaults.

        Unknown keys: kept verbatim in `extras` when the family allows them (upstream's own loader drops them
        silently; we keep them for round trips), else an error listing the known fields."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"config must be a dict of fields, got {type(d).__name__}")
        known = set(cls.field_names())
        unknown = [k for k in d if k not in known]
        if unknown and not cls.keeps_unknown:
            raise ConfigError(f"unknown config key(s) {', '.join(map(repr, sorted(map(str, unknown))))}; "
                              f"{cls.title()} fields are: {', '.join(sorted(known))}")
        bad = [k for k in unknown if not isinstance(k, str)]
        if bad:
            raise ConfigError(f"config key {bad[0]!r} is not a string")
        kwargs = {k: v for k, v in d.items() if k in known}
        if unknown:
            kwargs["extras"] = tuple((k, d[k]) for k in unknown)
        return cls(**kwargs)

    @classmethod
    def title(cls) -> str:
        return f"Needle {cls.family}"

    def to_dict(self, *, only_non_default: bool = False) -> dict[str, Any]:
        """Every field (then any kept unknown keys), or only the fields that differ from upstream's defaults."""
        out = {f.name: getattr(self, f.name) for f in self.fields()}
        if only_non_default:
            out = {f.name: out[f.name] for f in self.fields() if out[f.name] != f.default}
        out.update(self.extra_keys())
        return out

    def extra_keys(self) -> dict[str, Any]:
        return dict(getattr(self, "extras", ()))

    def upstream_dict(self) -> dict[str, Any]:
        """The config dict as upstream's trainer pickles it (only the fields that were set); families refine it."""
        return self.to_dict(only_non_default=True)

    def differences(self, other: FamilyConfig) -> dict[str, tuple[Any, Any]]:
        """{field: (self's value, other's)} for the fields that differ (kept unknown keys are not compared)."""
        if type(other) is not type(self):
            return {"family": (self.family, other.family)}
        return {f.name: (getattr(self, f.name), getattr(other, f.name)) for f in self.fields()
                if getattr(self, f.name) != getattr(other, f.name)}

    def replace(self, **changes: Any):
        return dataclasses.replace(self, **changes)


def coerce(name: str, kind: str, value: Any) -> Any:
    """Accept numpy scalars and lists from pickles and JSON; refuse lossy or wrong-kind values."""
    if kind == "bool":
        if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
            return bool(value)
        raise ConfigError(f"config.{name} must be true or false, got {value!r}")
    if kind == "int":
        return _int(name, value)
    if kind == "float":
        if isinstance(value, (bool, str)):
            raise ConfigError(f"config.{name} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config.{name} must be a number, got {value!r}") from None
    if kind == "tuple[int, ...]":
        if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
            raise ConfigError(f"config.{name} must be a list of integers, got {value!r}")
        return tuple(_int(name, v) for v in value)
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"config.{name} must be a string, got {value!r}")
        return value
    return value  # extras: kept as given


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"config.{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"config.{name} must be an integer, got {value!r}") from None


def positive(config: FamilyConfig, names: tuple[str, ...], minimum: int = 1, why: str = "") -> None:
    for name in names:
        if getattr(config, name) < minimum:
            raise ConfigError(f"config.{name} must be >= {minimum}{why}, got {getattr(config, name)}")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def check_heads(width_name: str, width: int, num_heads: int, num_kv_heads: int) -> None:
    """width % num_heads, num_heads % num_kv_heads, and an even head_dim (half-split RoPE)."""
    if width % num_heads:
        raise ConfigError(f"config.{width_name}={width} is not divisible by num_heads={num_heads}; "
                          f"pick num_heads from {divisors(width)}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"config.num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}; "
                          f"pick num_kv_heads from {divisors(num_heads)}")
    if (width // num_heads) % 2:
        raise ConfigError(f"config head_dim = {width_name}/num_heads = {width // num_heads} is odd; half-split RoPE "
                          "needs an even head_dim")
