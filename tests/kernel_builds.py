"""A kernel module (needle_torch.cpu_attention, needle_torch.cpu_decode) made to fail its build, for the tests of the
build-once-or-warn rule (kernels.build_once)."""

from __future__ import annotations

import pytest


def without_compiler(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """module's builds raise as if no C++ compiler were installed, and nothing it built or tried is remembered."""
    def fail(*args):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(module, "_build", fail)
    monkeypatch.setattr(module, "_built", {})
    monkeypatch.setattr(module, "_ready", {})
