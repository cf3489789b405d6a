"""Rounding flips at the activation quantisers: tell a value that fell one step apart in two correct runs from a bug.

A8 fake-quant is discontinuous: x / scale within float32 noise of a k + ½ boundary rounds to k on one side and
k + 1 on the other, and attention carries that one-step change forward to every later position of the row.
Upstream's own code does this between two CPUs (issue 48: 4.26e-3 in one row, from position 8 on). So a
comparison of quant=True outputs records, at every activation quantiser call of a forward on each side, the
quantiser's input; walks the calls in order; and keeps an affected-positions mask A (B, T):

- codes that differ at a position outside A, by one step, with both sides within FLIP_ULPS of the boundary, are
  a flip: reported, and (row b, positions >= t) joins A, because causal attention (and the causal conv taps)
  carry a change at position t to every later position of that row and never to an earlier one or another row;
- codes that differ outside A any other way are a real divergence: the comparison fails.

The outputs are then judged outside A at the unchanged budget (`masked_rel`). If A covers more than
MAX_AFFECTED of the positions the comparison fails too: a bug must not hide behind flips.

Aligned runs leave nothing unjudged: where the reference's calls are known before the torch forward runs (the
parity engine runs Flax first), `trace_torch(model, align=ref_calls)` gives each flipped element the reference's
code as it happens, so the torch forward goes on from the reference's rounding; `compare(..., aligned=True)` then
reports the flips without growing A and the outputs are judged at every position. A deep model needs this: 20
layers of A8 calls on a 4 × 64 batch flip a dozen values, early enough to reach almost every position.

The comparison works on numpy arrays; `trace_torch` and `trace_flax` record the calls of the Needle 2 and
Needle 3 twins without touching their files, by patching the quantiser each family's modules call
(`TORCH_QUANTISERS`, `FLAX_QUANTISERS`). `rounding_flips` is the parity engine's quant-pass check for both.

Shapes: B batch, T length, D the quantised (last) axis; a call's input is (B, ..., T, D): rows on axis 0,
positions on axis -2 (every activation quantiser of the twins: (B, T, D) and per-head (B, H, T, h)).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from needle_flax.v2 import lanes as flax_lanes
from needle_flax.v3 import model as flax_model
from needle_flax.v3 import quant as flax_quant
from needle_torch.v2 import lanes as torch_lanes
from needle_torch.v3 import model as torch_model
from needle_torch.v3 import quant as torch_quant

# Where each family's modules look up their activation quantiser: (module, attribute, site kind). Needle 2's
# `aq` calls lanes.fake_quant_act; Needle 3's modules hold their own bindings (q, k and v quantised per head).
TORCH_QUANTISERS = {"v2": ((torch_lanes, "fake_quant_act", "act"),),
                    "v3": ((torch_model, "fake_quant_act", "act"), (torch_quant, "fake_quant_act", "qkv"))}
FLAX_QUANTISERS = {"v2": ((flax_lanes, "fake_quant_act", "act"),),
                   "v3": ((flax_model, "_fake_quant", "act"), (flax_quant, "_fake_quant", "qkv"))}

# Margins are counted in units of the float32 spacing of x / scale at the top of the code range (ulp(qmax): 2^-17
# of a step for A8), not of the element itself: the quantisers' inputs are sums over the row (matmuls, norms), so
# their float32 noise scales with the row's largest value, which maps to ±qmax. Measured between the twins
# (float32, quant=True) where their codes agree: |Δ(x / scale)| ≤ 21 of these units on the Needle 3 goldens
# (1.6e-4 of a step, from the twins' float32 agreement of ~3e-7 at the logits) and ≤ 69 on the 127.2M default
# (20 layers, aligned run). Both sides of a flip lie within that noise of the boundary they straddle, so 256 (3.7x
# the largest measured, 2e-3 of a step) admits every rounding either twin could have made, and nothing a real change
# makes: a 1e-3 relative weight error moves x / scale by ~0.1 step, ~10^4 units.
FLIP_ULPS = 256.0
# At most half the positions may be affected: past that the flips would hide a real divergence, not explain noise.
MAX_AFFECTED = 0.5


@dataclasses.dataclass(frozen=True)
class Call:
    """One quantiser call: its input and forward value (float32), its bit width and where it ran. The codes are
    read from the forward value, not recomputed: a compiler may evaluate x / scale differently (XLA does), and a
    flip is about the rounding each side actually made."""

    x: np.ndarray  # (B, ..., T, D)
    q: np.ndarray  # (B, ..., T, D): the quantiser's output, codes · scale
    bits: int
    site: str = ""  # e.g. "stack.layers.2.block.self_attn:qkv"; empty where the tracer cannot tell
    layer: int | None = None


@dataclasses.dataclass(frozen=True)
class Event:
    """A code that differs between the sides outside A: a flip or a real divergence."""

    call: int
    site: str
    layer: int | None
    row: int
    position: int
    index: tuple[int, ...]  # the element's full index in the call's input
    codes: tuple[int, int]  # (ref, got)
    margins: tuple[float, float]  # (ref, got), in FLIP_ULPS units

    def __str__(self) -> str:
        where = f"call {self.call}" + (f" ({self.site})" if self.site else "") + (
            f" layer {self.layer}" if self.layer is not None else "")
        return (f"{where} row {self.row} position {self.position} element {self.index[1:-2] + self.index[-1:]}: "
                f"codes {self.codes[0]} vs {self.codes[1]}, margins {self.margins[0]:.2f} / {self.margins[1]:.2f} ulp")


@dataclasses.dataclass(frozen=True)
class FlipReport:
    flips: list[Event]
    divergences: list[Event]
    affected: np.ndarray  # (B, T) bool: A
    calls: int
    noise: float  # the largest |Δ(x / scale)| between the sides where their codes agree outside A, in ulp(qmax)
    aligned: bool = False  # the flips were given the reference's codes in the run (A stays empty)

    @property
    def coverage(self) -> float:
        return float(self.affected.mean()) if self.affected.size else 0.0

    @property
    def ok(self) -> bool:
        return not self.divergences and self.coverage <= MAX_AFFECTED

    def summary(self) -> str:
        lines = [f"{self.calls} quantiser calls: {len(self.flips)} flip(s), {len(self.divergences)} real "
                 f"divergence(s); affected positions {self.affected.sum()}/{self.affected.size}; "
                 f"float32 noise elsewhere ≤ {self.noise:.1f} ulp (flips within {FLIP_ULPS:g})"
                 + ("; flips aligned to the reference's codes, every position judged" if self.aligned else "")]
        lines += [f"  flip: {e}" for e in self.flips[:10]]
        if len(self.flips) > 10:
            lines.append(f"  ... and {len(self.flips) - 10} more flips (every one in the JSON report)")
        lines += [f"  DIVERGENCE: {e}" for e in self.divergences[:10]]
        if len(self.divergences) > 10:
            lines.append(f"  ... and {len(self.divergences) - 10} more")
        if self.coverage > MAX_AFFECTED:
            lines.append(f"  FAIL: flips affect {self.coverage:.0%} of the positions (at most {MAX_AFFECTED:.0%}): "
                         "too many to be float32 noise; look for a real difference before the first flip")
        return "\n".join(lines)


def row_scale(x: np.ndarray, bits: int) -> np.ndarray:
    """The per-row symmetric fake-quant's step, in float32: max|x| / qmax over the last axis (1 for an all-zero
    row); (..., 1)."""
    qmax = 2 ** (bits - 1) - 1
    amax = np.abs(np.asarray(x, np.float32)).max(-1, keepdims=True)
    return np.where(amax > 0, amax / np.float32(qmax), np.float32(1)).astype(np.float32)


def codes_and_margin(x: np.ndarray, bits: int, q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The integer codes of one quantiser call on x (..., D) and each element's distance from the nearest rounding
    boundary k + ½ of x / scale, in units of ulp(qmax) (FLIP_ULPS). The codes are q / scale rounded (q the call's
    output: exact, a code is far from the half-way point of q's float32 rounding) or, without q,
    clip(round_half_even(x / scale), -qmax - 1, qmax)."""
    qmax = 2 ** (bits - 1) - 1
    scale = row_scale(x, bits)
    y = (np.asarray(x, np.float32) / scale).astype(np.float32)
    if q is None:
        codes = np.clip(np.rint(y), -qmax - 1, qmax).astype(np.int32)
    else:
        codes = np.rint(np.asarray(q, np.float32) / scale).astype(np.int32)
    a = np.abs(y.astype(np.float64))
    margin = np.abs(a - np.floor(a) - 0.5) / _ulp(bits)
    return codes, margin


def compare(ref: Sequence[Call], got: Sequence[Call], max_ulps: float = FLIP_ULPS,
            aligned: bool = False) -> FlipReport:
    """Walk both sides' calls in order (module doc). Sites and layers come from whichever side names them.
    aligned: `got` was traced with `trace_torch(..., align=ref)`, so a flip changed nothing downstream."""
    if len(ref) != len(got):
        raise ValueError(f"the two forwards made {len(ref)} and {len(got)} quantiser calls: they do not run the same "
                         "graph (check quant / act_bits / kv_bits on both sides)")
    if not ref:
        return FlipReport([], [], np.zeros((0, 0), bool), 0, 0.0)
    B, T = ref[0].x.shape[0], ref[0].x.shape[-2]
    affected = np.zeros((B, T), bool)
    flips, divergences, noise = [], [], 0.0
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        if r.x.shape != g.x.shape or r.bits != g.bits or r.x.shape[0] != B or r.x.shape[-2] != T:
            raise ValueError(f"quantiser call {i}: shapes {r.x.shape} / {g.x.shape}, bits {r.bits} / {g.bits}; "
                             f"expected (B={B}, ..., T={T}, D) with equal bits: the sides' call orders differ")
        cr, mr = codes_and_margin(r.x, r.bits, r.q)
        cg, mg = codes_and_margin(g.x, g.bits, g.q)
        outside = ~affected.reshape(B, *[1] * (r.x.ndim - 3), T, 1)  # (B, 1.., T, 1)
        differ = (cr != cg) & outside
        dy = np.abs(r.x / row_scale(r.x, r.bits) - g.x / row_scale(g.x, g.bits)) / _ulp(r.bits)
        noise = max(noise, float(np.where(outside & (cr == cg), dy, 0).max()))
        near = (np.abs(cr - cg) == 1) & (mr <= max_ulps) & (mg <= max_ulps)
        site = max(r.site, g.site, key=len)  # the more specific name (the Flax tracer only says act / qkv)
        layer = r.layer if r.layer is not None else g.layer
        new = []
        for idx in zip(*np.nonzero(differ), strict=True):
            idx = tuple(int(j) for j in idx)
            e = Event(i, site, layer, idx[0], idx[-2], idx, (int(cr[idx]), int(cg[idx])),
                      (float(mr[idx]), float(mg[idx])))
            (flips if near[idx] else divergences).append(e)
            if near[idx]:
                new.append(e)
        for e in new if not aligned else ():  # after the whole call: its other elements came before the flip
            affected[e.row, e.position:] = True
    return FlipReport(flips, divergences, affected, len(ref), noise, aligned)


def near_boundary(calls: Sequence[Call], max_ulps: float) -> np.ndarray:
    """(B, T) bool: from each position on where some element of these calls lies within max_ulps of a rounding
    boundary, to the end of its row: where a run whose float32 arithmetic differs by a few ulps (another CPU's
    compiled code) may have rounded the other way, when only its outputs are known."""
    if not calls:
        return np.zeros((0, 0), bool)
    B, T = calls[0].x.shape[0], calls[0].x.shape[-2]
    affected = np.zeros((B, T), bool)
    for c in calls:
        near = codes_and_margin(c.x, c.bits, c.q)[1] <= max_ulps
        for idx in zip(*np.nonzero(near), strict=True):
            affected[idx[0], idx[-2]:] = True
    return affected


def flipped(x: np.ndarray, q: np.ndarray, ref: Call, bits: int, max_ulps: float = FLIP_ULPS) -> np.ndarray:
    """The code steps (ref - got, each -1, 0 or 1) that give one call's flipped elements the reference's codes:
    nonzero where the codes differ by one step with both sides within max_ulps of the boundary (`compare`'s flip);
    a code that differs any other way is left alone, to fail as a divergence."""
    if ref.x.shape != x.shape or ref.bits != bits:
        return np.zeros(x.shape, np.int32)  # the call orders differ: compare says so
    cr, mr = codes_and_margin(ref.x, bits, ref.q)
    cg, mg = codes_and_margin(x, bits, q)
    near = (np.abs(cr - cg) == 1) & (mr <= max_ulps) & (mg <= max_ulps)
    return np.where(near, cr - cg, 0).astype(np.int32)


def _ulp(bits: int) -> float:
    """FLIP_ULPS' unit: the float32 spacing at qmax (2^-17 for A8)."""
    return float(np.spacing(np.float32(2 ** (bits - 1) - 1)))


def masked_rel(got: np.ndarray, ref: np.ndarray, affected: np.ndarray) -> float:
    """max|got - ref| / max|ref| over the positions outside A; got and ref are (B, T, ...), affected (B, T)."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    keep = ~np.asarray(affected, bool)
    if not keep.any():
        return 0.0
    d, r = np.abs(got - ref)[keep], np.abs(ref)[keep]
    return float(d.max() / max(r.max(), 1e-30))


# ----------------------------------------------------------------------------- tracers


@contextlib.contextmanager
def trace_torch(model, align: Sequence[Call] | None = None) -> Iterator[list[Call]]:
    """Record every activation quantiser call of the torch twin `model` (Needle 2: A8 activations; Needle 3: also
    per-head q and A8 k/v) inside the block; each call named by the innermost module running it. The model files
    are untouched: the quantiser their modules look up (TORCH_QUANTISERS) is swapped for a recorder.
    align: the reference's calls of the same forward; each call's flips (`flipped`) take the reference's codes
    (recorded as the twin computed them, returned as the reference rounded)."""
    calls: list[Call] = []
    stack: list[str] = []
    hooks = []

    def leave(module, args, output) -> None:  # returns None: the output stays as it is
        stack.pop()

    for name, module in model.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a, name=name: stack.append(name)))
        hooks.append(module.register_forward_hook(leave))
    patched = []
    for module, attr, kind in TORCH_QUANTISERS[model.family]:
        real = getattr(module, attr)

        def recorder(x, bits=8, real=real, kind=kind):
            where = stack[-1] if stack else ""
            m = re.search(r"layers\.(\d+)", where)
            out = real(x, bits)
            call = Call(x.detach().float().cpu().numpy(), out.detach().float().cpu().numpy(), bits,
                        f"{where or 'model'}:{kind}", int(m.group(1)) if m else None)
            if align is not None and len(calls) < len(align):
                steps = flipped(call.x, call.q, align[len(calls)], bits)
                if steps.any():  # one step of this row's scale at each flipped element
                    scale = torch.from_numpy(row_scale(call.x, bits)).to(out.device)
                    out = out + (torch.from_numpy(steps).to(out.device) * scale).to(out.dtype)
            calls.append(call)
            return out

        setattr(module, attr, recorder)
        patched.append((module, attr, real))
    try:
        yield calls
    finally:
        for module, attr, real in patched:
            setattr(module, attr, real)
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def trace_flax(family: str = "v3") -> Iterator[list[Call]]:
    """Record every activation quantiser call of the Flax twin of `family` traced inside the block: the quantiser
    its modules look up (FLAX_QUANTISERS) is wrapped in an ordered `jax.debug.callback`, which runs in program
    order inside the layer scan, conds and jit. Trace a fresh function inside the block (a jit cached from before
    has no callbacks); the list is complete once the outputs are ready (`jax.effects_barrier`). Sites are "act" or
    "qkv" only: inside the scan the layer is not known in Python (`compare` takes the torch side's names)."""
    calls: list[Call] = []
    patched = []
    for module, attr, kind in FLAX_QUANTISERS[family]:
        real = getattr(module, attr)

        def recorder(x, bits=8, real=real, kind=kind):
            out = real(x, bits)
            jax.debug.callback(lambda a, q, bits=bits, kind=kind: calls.append(
                Call(np.asarray(a), np.asarray(q), bits, kind)), x.astype(jnp.float32), out.astype(jnp.float32),
                ordered=True)
            return out

        setattr(module, attr, recorder)
        patched.append((module, attr, real))
    try:
        yield calls
    finally:
        jax.effects_barrier()
        for module, attr, real in patched:
            setattr(module, attr, real)


# ----------------------------------------------------------------------------- the parity engine's quant pass

QUANT_PROBES = ("quant_logits",)


def record(twins, side: str, calls: list[Call]) -> None:
    """Keep one side's ("flax", "torch") quant-pass calls on the twins for `rounding_flips`."""
    twins.quant_calls = {**getattr(twins, "quant_calls", {}), side: calls}


def reference_calls(twins) -> list[Call] | None:
    """The Flax side's quant-pass calls, recorded before the torch pass runs (its `align`)."""
    return getattr(twins, "quant_calls", {}).get("flax")


def rounding_flips(twins, ref: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """The report's `flips` section: both sides' quantiser calls of the quant pass walked (compare). The torch pass
    ran aligned to the Flax calls (each flip took Flax's code), so the budget judges the whole quant probes
    unchanged; a code that differs any other way is a divergence and fails the report. None: no pass traced."""
    calls = getattr(twins, "quant_calls", {})
    if "flax" not in calls or "torch" not in calls:
        return None
    found = compare(calls["flax"], calls["torch"], aligned=True)

    def event(e: Event) -> dict[str, Any]:
        return {"call": e.call, "site": e.site, "layer": e.layer, "row": e.row, "position": e.position,
                "index": list(e.index), "codes": list(e.codes), "margins_ulp": list(e.margins)}

    return {"ok": found.ok, "probes": list(QUANT_PROBES), "calls": found.calls, "count": len(found.flips),
            "flips": [event(e) for e in found.flips], "divergences": len(found.divergences),
            "first_divergences": [event(e) for e in found.divergences[:10]],
            "affected_positions": int(found.affected.sum()), "positions": int(found.affected.size),
            "affected": [[int(b), int(t)] for b, t in zip(*np.nonzero(found.affected), strict=True)],
            "noise_ulp": found.noise, "flip_ulps": FLIP_ULPS, "max_affected": MAX_AFFECTED,
            "aligned": found.aligned, "summary": found.summary()}


__all__ = ["FLAX_QUANTISERS", "FLIP_ULPS", "MAX_AFFECTED", "QUANT_PROBES", "TORCH_QUANTISERS", "Call", "Event",
           "FlipReport", "codes_and_margin", "compare", "flipped", "masked_rel", "record", "reference_calls",
           "rounding_flips", "trace_flax", "trace_torch"]
