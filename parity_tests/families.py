"""The parity adapters of every family, looked up by name or by a config's family.

Adding a family means adding `parity_tests/<family>/` and one line here.
"""

from __future__ import annotations

from typing import Any

from convert.errors import ConfigError
from convert.registry import FAMILIES, family_named, family_of
from parity_tests.adapter import Adapter
from parity_tests.tolerances import Profile, get_profile
from parity_tests.v1.adapter import ADAPTER as V1
from parity_tests.v2.adapter import ADAPTER as V2
from parity_tests.v3.adapter import ADAPTER as V3

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (V1, V2, V3)}


def adapter_named(name: str) -> Adapter:
    """The adapter of a registered family; an error naming the ones that have one otherwise."""
    family = family_named(name)  # an unknown name: the registry's one-line error
    if name not in ADAPTERS:
        raise ConfigError(f"{family.title} has no parity twins yet; the parity suite runs "
                          f"{', '.join(FAMILIES[n].title for n in ADAPTERS)}")
    return ADAPTERS[name]


def adapter_of(config: Any) -> Adapter:
    return adapter_named(family_of(config).name)


def profile(config: Any, dtype: str, device: str = "cpu") -> Profile:
    """The tolerance profile of the config's family for a dtype and device class."""
    return get_profile(adapter_of(config).budgets, dtype, device)
