"""Upstream's Needle 3 goldens in tests/data/v3: the shared fixture `needle-v3-tiny` and the configs
tools/upstream_goldens.sh makes (each `NAME.npz` beside its checkpoint `NAME.safetensors` and the `NAME.command`
that made both). Arrays are under `f32/` (float32 config and params) and `bf16/` (bfloat16 config, params cast
to bfloat16 first), stored as float32.
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path

import ml_dtypes
import numpy as np

from convert.io import read_checkpoint
from convert.v3 import TransformerConfig

DATA = Path(__file__).resolve().parents[1] / "data" / "v3"
F32_REL = 1e-5  # the project's float32 budget (max|a - b| / max|ref|); upstream vs an f64 reference: 2.3e-6 abs
# a golden is NAME.npz beside NAME.safetensors (NAME.cact.npz and NAME.text.npz are other fixtures' goldens)
NAMES = tuple(sorted(p.stem for p in DATA.glob("*.npz") if (DATA / f"{p.stem}.safetensors").exists()))


@dataclasses.dataclass(frozen=True)
class Golden:
    name: str
    config: TransformerConfig  # as stored (dtype as upstream saved it)
    params: dict  # upstream's float32 tree
    arrays: dict[str, np.ndarray]

    def config_for(self, dtype: str) -> TransformerConfig:
        return dataclasses.replace(self.config, dtype=dtype)

    def params_for(self, dtype: str) -> dict:
        """The params as upstream's goldens used them: float32, or every leaf cast to bfloat16 first."""
        if dtype == "float32":
            return self.params
        return _map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16), self.params)

    def has(self, key: str) -> bool:
        return key in self.arrays

    @property
    def depth(self) -> int:
        """The ladder depth of the exit, subnetwork and ladder goldens."""
        if "depth" in self.arrays:
            return int(self.arrays["depth"])
        return int(self.meta["knobs"]["depth"])

    @property
    def meta(self) -> dict:
        return json.loads(str(self.arrays["meta_json"])) if "meta_json" in self.arrays else {}


@cache
def load(name: str) -> Golden:
    ck = read_checkpoint(DATA / f"{name}.safetensors")
    with np.load(DATA / f"{name}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return Golden(name, ck.config, ck.params, arrays)


def rel(a, ref) -> float:
    """max|a - ref| / max|ref| in float64 (NaN-free inputs assumed)."""
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30))


def top1_agreement(logits, ref) -> float:
    return float((np.asarray(logits).argmax(-1) == np.asarray(ref).argmax(-1)).mean())


def _map(fn, tree):
    return {k: _map(fn, v) for k, v in tree.items()} if isinstance(tree, dict) else fn(tree)


# Upstream's goldens come from XLA code compiled for the CPU that made them; another CPU's (without AVX-512, say)
# moves x / scale by an ulp or two, so an element that close to a rounding boundary may round the other way there.
# Measured: mqa's one flip against its golden on an AVX2-only CPU sits within 1 ulp (and masks 38 % of its positions).
GOLDEN_ULPS = 4.0


def twin_quant_flips(config: TransformerConfig, params: dict, tokens: np.ndarray):
    """Both twins' float32 quant=True forwards traced at every A8 quantizer, compared (parity_tests/flips.py):
    (the report, whose `affected` positions are where a rounding flip between two correct runs reached; the same
    report with also the positions from an element within GOLDEN_ULPS of a boundary on, for a flip against
    upstream's goldens, whose codes are unknown). XLA's fusion (and so which values sit a few ulps off a boundary)
    depends on its flags and the CPU, so upstream's goldens are judged outside them."""
    import jax
    import jax.numpy as jnp
    import torch

    import convert
    from needle_flax.v3 import SimpleAttentionNetwork as FlaxNetwork
    from needle_torch.v3 import SimpleAttentionNetwork as TorchNetwork
    from parity_tests import flips

    net = FlaxNetwork(config)
    with jax.default_matmul_precision("highest"), flips.trace_flax() as flax_calls:
        jax.block_until_ready(jax.jit(lambda p, t: net.apply({"params": p}, t, quant=True))(
            jax.tree.map(jnp.asarray, params), jnp.asarray(tokens)))
    sd = convert.flax_to_torch(params, config)
    model = TorchNetwork(config, groups=tuple(h for h in ("embedding_head", "confidence_head", "router_head")
                                              if any(k.startswith(h) for k in sd)))
    model.load_state_dict(sd, strict=True)
    with torch.no_grad(), flips.trace_torch(model) as torch_calls:
        model(torch.as_tensor(tokens).long(), quant=True)
    report = flips.compare(flax_calls, torch_calls)
    near = flips.near_boundary(flax_calls, GOLDEN_ULPS)
    return report, dataclasses.replace(report, affected=report.affected | near)
