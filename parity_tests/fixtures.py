"""Where the upstream golden files are (tests/data, documented in its README.md and README-cact.md)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
FIXTURE_PKL = DATA / "needle-v1-tiny.pkl"  # Needle v1
FIXTURE_NPZ = DATA / "needle-v1-tiny.npz"
V2_PKL = DATA / "needle-v2-tiny.pkl"  # Needle 2: checkpoint, goldens, adapter, tokenizer, .cact builds
V2_NPZ = DATA / "needle-v2-tiny.npz"
V2_LORA = DATA / "needle-v2-tiny.lora.pkl"
V2_SPM = DATA / "needle-v2-tiny.spm.model"
V2_QUANT = DATA / "needle-v2-tiny.quant.npz"
