"""A kernel module of needle_torch.fast (cpu_decode)
made to fail its build or to record it, for the tests of the build-once-or-warn rule (kernels.build_once) and of when
a module builds at all."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest

from needle_torch.fast import kernels


def without_compiler(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """module's builds raise as if no C++ compiler were installed, and nothing it built or tried is remembered."""
    def fail(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(module, "_build", fail)
    monkeypatch.setattr(module, "_built", {})
    monkeypatch.setattr(module, "_ready", {})


def recording_builds(monkeypatch: pytest.MonkeyPatch, module) -> list[tuple]:
    """module's builds only record their arguments, in the list returned, and nothing it built or tried is
    remembered."""
    builds: list[tuple] = []
    monkeypatch.setattr(module, "_build", lambda *key: builds.append(key))
    monkeypatch.setattr(module, "_built", {})
    monkeypatch.setattr(module, "_ready", {})
    return builds


def assert_warns_once(prepare: Callable[[], object]) -> None:
    """prepare() of a module made without_compiler warns with its KernelBuildWarning the first time and is silent
    the second (a build is tried once a process)."""
    with pytest.warns(kernels.KernelBuildWarning, match="no C[+][+] compiler"):
        prepare()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        prepare()
