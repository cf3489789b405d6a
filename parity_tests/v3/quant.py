"""Quantization damage for Needle 3, three-way as upstream's own table: the float model, upstream's deploy fake-quant
(`quant=True` on the CQ-STE tree: CQ weights, A8 activations, A8 routing input, per-head A8 queries, the KV
quantiser, CQ-4 heads) and the `.cact` as read (its tree with the same deploy numerics, what the engine computes).
Torch only (no JAX); every figure counts real (non-pad) positions only.

- the figures of parity_tests/quant.py (KL mean ± s.e., median, p99, p99.9, max; same top-1; RMS Δp) for each
  quantized model against the float one, and the `.cact` against the fake-quant;
- greedy decoding of the float and the judged model from the same prompts;
- per attribution unit (embedding, each layer, each engram site, final_norm): the KL when only that unit's weights
  are quantized, and its output state's error with everything quantized;
- per CQ tensor: SQNR and bits;
- per deploy-numerics site, switched on one at a time over the CQ weights (weights only; + A8 activations; + the
  routing input; + the query; + KV; + heads) and each alone over the float weights: which site costs what;
- per ladder rung (`depth`): each rung's KL against the full float model, float and quantized;
- with a `.cact`: its CQ records against this project's CQ of the float weights, group by group, with rounding flips
  told from real differences (parity_tests/cq_flips.py); a file whose groups mostly differ was not exported from
  this checkpoint and is refused.

Shapes: B batch, T length, V vocab, D d_model, n lanes, L layers, R real positions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convert.errors import ConfigError, NeedleTwinError
from convert.io import read_checkpoint
from convert.mapping import flax_to_torch_numpy
from convert.trees import flatten_tree, unflatten_tree
from convert.v2.bits import groups_along_input, is_quant_leaf
from convert.v2.cq import cq_quantize, quantize_leaf, width_of_record
from convert.v3 import FAMILY, TransformerConfig, ladder_layer_indices
from convert.v3.cact import CQ, CactFile, read_cact, to_params
from convert.v3.lora import check_adapter, merged_params, read_adapter
from needle_torch.v3 import SimpleAttentionNetwork
from needle_torch.v3 import model as torch_model
from parity_tests import cq_flips
from parity_tests.inputs import Batch, InputError, as_token_array, check_sizes, check_tokens, read_token_file
from parity_tests.outputs import check_outputs, write_outputs
from parity_tests.quant import (
    environment,
    greedy_decode,
    greedy_figures,
    logit_figures,
    pinned_torch,
    prompt_ends,
    quant_device,
    refuse_foreign_cact,
    sqnr_db,
    state_error,
)
from parity_tests.quant import torch_index as family_torch_index
from parity_tests.quant_report import QuantReport, Thresholds, render_html, score, to_json

DEFAULT_BATCH, DEFAULT_SEQ_LEN, DEFAULT_STEPS = 4, 32, 8
BOS_ID, FIRST_PLAIN_ID = 2, 20  # ids 0-19 are PAD, EOS, BOS, UNK and the 16 chat markers
# The deploy-numerics sites, in the order the per-site table switches them on (NEEDLE_V3.md §5).
SITES = ("act", "routing", "query", "kv", "heads")
SITE_TITLES = {"weights": "CQ weights only", "act": "+ A8 activations (attention in/out, engram e, pre-logit x)",
               "routing": "+ A8 routing input (mHC x̂)", "query": "+ per-head A8 query", "kv": "+ KV quantiser",
               "heads": "+ CQ-4 head matrices (head outputs only)"}
CQ_CHECK_REL = 1e-5  # the project's float32 budget for a CQ group both builds quantised alike
_HEADS = ("embedding_head", "confidence_head", "router_head")
_SAME_MODEL = ("vocab_size", "d_model", "num_heads", "num_kv_heads", "num_layers", "qk_head_dim", "v_head_dim",
               "head_dims", "engram_orders", "engram_slots", "engram_layers", "global_layers", "sliding_window",
               "mhc_lanes", "qkv_conv_taps", "out_vocab", "num_engram_tables", "engram_sub_dim")


# ----------------------------------------------------------------------------- switching the deploy sites


@contextlib.contextmanager
def deploy_sites(sites: Sequence[str]) -> Iterator[None]:
    """Inside the block, `quant=True` on the Needle 3 torch twin applies only `sites` (of SITES). The model file is
    untouched: its quantiser entry points (`_aq`, `quant_query`, `quant_kv`, `head_weight`) are wrapped to pass
    quant through only for the sites on, as parity_tests/flips.py wraps them to trace. `_aq` serves two sites: the
    routing input when an MHCLayer calls it, the A8 activations otherwise."""
    unknown = sorted(set(sites) - set(SITES))
    if unknown:
        raise ConfigError(f"unknown deploy site(s) {unknown}; choose from {', '.join(SITES)}")
    on = set(sites)
    m = torch_model
    real = {name: getattr(m, name) for name in ("_aq", "quant_query", "quant_kv", "head_weight")}

    def aq(x, quant, bits):
        caller = sys._getframe(1).f_locals.get("self")
        site = "routing" if isinstance(caller, m.MHCLayer) else "act"
        return real["_aq"](x, bool(quant) and site in on, bits)

    m._aq = aq
    m.quant_query = lambda q, quant, config: real["quant_query"](q, bool(quant) and "query" in on, config)
    m.quant_kv = lambda x, quant, config: real["quant_kv"](x, bool(quant) and "kv" in on, config)
    m.head_weight = lambda w, quant: real["head_weight"](w, bool(quant) and "heads" in on)
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(m, name, fn)


# ----------------------------------------------------------------------------- inputs and trees


def quant_batch(config: TransformerConfig, *, inputs: Any = None, batch: int = DEFAULT_BATCH,
                seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0) -> Batch:
    """The tokens: a token file (.npy, .npz or .json with `tokens`), an array or id rows, or (None) a seeded random
    batch: BOS then plain ids (>= 20), row 0 full length, the others right-padded to varied lengths."""
    pad = config.pad_token_id
    if inputs is None:
        check_sizes(batch=batch, seq_len=seq_len)
        rng = np.random.default_rng(seed)
        tokens = rng.integers(FIRST_PLAIN_ID, config.vocab_size, (batch, seq_len))
        tokens[:, 0] = BOS_ID
        for b in range(1, batch):
            tokens[b, max(2, seq_len - b * max(1, seq_len // (2 * batch))):] = pad
        return Batch({"tokens": tokens.astype(np.int64)}, f"random (seed {seed})")
    if isinstance(inputs, (str, os.PathLike)):
        found = read_token_file(inputs, "tokens", ("tokens",))
        tokens, source = found["tokens"], str(inputs)
    else:
        tokens, source = inputs, "given ids"
    tokens = check_tokens(as_token_array(tokens, "tokens", pad), config.vocab_size, "tokens")
    if not (tokens != pad).any():
        raise InputError(f"tokens hold only the pad id {pad}: there is no real position to compare; give some "
                         "real token ids")
    return Batch({"tokens": tokens}, source)


def widen(params: Mapping[str, Any]) -> dict[str, Any]:
    return unflatten_tree({k: np.asarray(v, np.float32) for k, v in flatten_tree(params).items()})


def fake_quant_tree(params32: Mapping[str, Any], bits: float = 4) -> dict[str, Any]:
    """The forward value of upstream's `cq_ste_params(params, bits)`: every quant leaf (kernels, embeddings,
    engram tables, φ) CQ-quantised, the rest as given."""
    flat = flatten_tree(params32)
    return unflatten_tree({p: quantize_leaf(p, a, bits) if is_quant_leaf(p, np.ndim(a)) else a
                           for p, a in flat.items()})


@dataclass(frozen=True)
class CactTree:
    params: dict[str, Any]  # the .cact's tree, with the leaves a .cact does not hold taken from the checkpoint
    cq: dict[str, tuple[float, bool]]  # CQ leaf path -> (bits, grouped along the input axis)
    description: dict[str, Any]
    notes: tuple[str, ...]
    weight_bits: float = 4.0  # the width of its weight records (the heads' are HEAD_BITS whatever it is)


def record_of(path: str) -> str:
    """The name of the (first) .cact record a CQ leaf is read from: its width is the leaf's."""
    parts = path.split("/")
    if path == "embedding/embedding":
        return "embedding"
    if path.startswith("stack/layers/"):
        return f"layer00.{parts[-2]}"  # q_proj, k_proj, v_proj, gate_proj, out_proj
    if path.startswith("stack/mhc_phi"):
        return parts[1]
    if path.startswith("engrams_"):
        g = parts[0][len("engrams_"):]
        return f"engram{g}.tables" if parts[1] == "embedding" else f"engram{g}.{parts[1]}"
    return f"{parts[0]}.{parts[1]}"  # <head>.probes, <head>.query, <head>.proj


def read_cact_tree(cact: str | os.PathLike | CactFile, config: TransformerConfig,
                   float_params: Mapping[str, Any]) -> CactTree:
    """The `.cact` as read (`to_params`), after checking its header describes the checkpoint's model."""
    f = cact if isinstance(cact, CactFile) else read_cact(cact)
    read = to_params(f)
    differ = {k: (getattr(read.config, k), getattr(config, k)) for k in _SAME_MODEL
              if getattr(read.config, k) != getattr(config, k)}
    if np.float32(read.config.rope_theta) != np.float32(config.rope_theta):  # the header holds θ as float32
        differ["rope_theta"] = (read.config.rope_theta, config.rope_theta)
    flat_f, flat_c = flatten_tree(float_params), flatten_tree(read.params)
    extra = sorted(p for p in flat_c if p not in flat_f)
    if differ or extra:
        what = "; ".join(f"{k}: .cact {a!r} vs checkpoint {b!r}" for k, (a, b) in differ.items())
        what = what or f"it holds {', '.join(extra)}, which the checkpoint lacks"
        raise ConfigError(f"{f.path} describes another model than the float checkpoint ({what}); give the .cact "
                          "exported from this checkpoint")
    record_widths = {r.name: float(width_of_record(r.bits)) for r in f.records if r.dtype == CQ}
    widths = sorted(set(record_widths.values()))
    kept = {p: a for p, a in flat_f.items() if p not in flat_c and p.startswith(_HEADS)}  # log_temp, the bias
    cq = {p: (record_widths[record_of(p)], groups_along_input(p)) for p, a in flat_c.items()
          if is_quant_leaf(p, np.ndim(a)) or (p.startswith(_HEADS) and p.endswith(("/probes", "/query")))}
    notes = [f"{f.path}: " + "; ".join(read.lines())]
    if kept:
        notes.append(f"{', '.join(sorted(kept))} are not in a .cact: taken from the checkpoint")
    if config.kv_bits != f.header["kv_bits"]:
        notes.append(f"the .cact header says kv_bits {f.header['kv_bits']} (the engine's), the checkpoint's config "
                     f"{config.kv_bits}: both quantized models run the config's")
    description = {"source": "cact", "cact": str(f.path), "records": len(f.records), "cq_bits": widths,
                   "lossy": read.lines()}
    return CactTree(unflatten_tree({**flat_c, **kept}), cq, description, tuple(notes),
                    record_widths.get("embedding", 4.0))


# ----------------------------------------------------------------------------- running the models


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


def build_model(params: Mapping[str, Any], config: TransformerConfig, device: torch.device) -> SimpleAttentionNetwork:
    model = SimpleAttentionNetwork.from_flax(params, config).to(device)
    with torch.no_grad():  # parameters of its own: the attribution writes into them
        for p in model.parameters():
            p.data = p.data.clone()
    return model


@torch.no_grad()
def logits_of(model: SimpleAttentionNetwork, tokens: torch.Tensor, quant: bool, sites: Sequence[str] = SITES,
              depth: int | None = None) -> np.ndarray:
    """float32 logits (B, T, V); quant with only `sites` on; depth: the rung's subnetwork (`subnetwork_only`)."""
    full = depth is None or depth >= model.config.num_layers
    with deploy_sites(sites):
        out = model(tokens, quant=quant) if full else model(tokens, quant=quant, exit_depth=depth,
                                                            subnetwork_only=True)
    return _numpy(out)


@torch.no_grad()
def states_of(model: SimpleAttentionNetwork, tokens: torch.Tensor, quant: bool) -> tuple[np.ndarray, dict]:
    """Logits and each unit's output state, read by forward hooks: embed (B, T, D), engram{g} the site's value
    (B, T, D), layer{i:02d} the lanes after layer i (B, T, n, D), final_norm (B, T, D)."""
    caps: dict[str, np.ndarray] = {}

    def keep(name: str, pick: Callable = lambda o: o):
        def hook(module, args, output):
            caps[name] = _numpy(pick(output))
        return hook

    hooks = [(model.embedding, "embedding", lambda o: o), (model.stack.final_norm, "final_norm", lambda o: o)]
    hooks += [(layer, f"layer{i:02d}", lambda o: o) for i, layer in enumerate(model.stack.layers)]
    hooks += [(e, f"engram{g}", lambda o: o[1]) for g, e in enumerate(model.engrams)]
    handles = [m.register_forward_hook(keep(name, pick)) for m, name, pick in hooks]
    try:
        logits = logits_of(model, tokens, quant)
    finally:
        for h in handles:
            h.remove()
    return logits, caps


@torch.no_grad()
def head_outputs(model: SimpleAttentionNetwork, tokens: torch.Tensor, quant: bool, sites: Sequence[str] = SITES
                 ) -> dict[str, np.ndarray]:
    """Each present head's output: the embedding (B, c), the confidence logit (B,), the router logits (B, 3)."""
    out = {}
    with deploy_sites(sites):
        for name, method in (("embedding_head", model.forward_embedding), ("confidence_head",
                             model.forward_confidence), ("router_head", model.forward_router)):
            if name in model.groups:
                out[name] = _numpy(method(tokens, quant=quant))
    return out


def head_figures(got: Mapping[str, np.ndarray], ref: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """Per head: max|Δ| and, for the embedding, the smallest cosine between the two models' rows."""
    out = {}
    for name, r in ref.items():
        g = got[name]
        figs = {"max_abs": float(np.max(np.abs(g.astype(np.float64) - r)))}
        if name == "embedding_head":
            num = (g.astype(np.float64) * r).sum(-1)
            den = np.linalg.norm(g.astype(np.float64), axis=-1) * np.linalg.norm(r.astype(np.float64), axis=-1)
            figs["min_cos"] = float(np.min(num / np.maximum(den, 1e-30)))
        out[name] = figs
    return out


def _short(figs: Mapping[str, Any]) -> dict[str, Any]:
    return {"kld_mean": figs["kld"]["mean"], "kld_stderr": figs["kld"]["stderr"], "kld_p99": figs["kld"]["p99"],
            "kld_max": figs["kld"]["max"], "same_top1": figs["same_top1"], "rms_dp": figs["rms_dp"]}


# ----------------------------------------------------------------------------- attribution units


def torch_index(config: TransformerConfig) -> dict[str, tuple[str, int | None]]:
    """torch state_dict name -> (Flax path, layer index or None), from the mapping rules."""
    return family_torch_index(FAMILY, config)


def unit_of(path: str, layer: int | None) -> str | None:
    """embedding, layerNN, engramG, final_norm; None off the logits path (the heads)."""
    if path.startswith("embedding/"):
        return "embedding"
    if layer is not None:
        return f"layer{layer:02d}"
    if path.startswith("engrams_"):
        return "engram" + path.split("/")[0].removeprefix("engrams_")
    if path.startswith("stack/final_norm"):
        return "final_norm"
    return None


def unit_order(config: TransformerConfig) -> list[str]:
    order = ["embedding"]
    for i in range(config.num_layers):
        order += [f"engram{g}" for g, site in enumerate(config.engram_layers) if site == i]
        order.append(f"layer{i:02d}")
    return order + ["final_norm"]


def tensor_name(path: str, layer: int | None) -> str:
    """`.cact`-style: layer03.q_proj, layer03.mhc_phi_res, engram0.tables, embedding, router_head.query."""
    parts = path.split("/")
    leaf = parts[-2] if parts[-1] in ("kernel", "scale") else parts[-1]
    if path.startswith("embedding/"):
        return "embedding"
    if path.startswith("engrams_"):
        g = parts[0].removeprefix("engrams_")
        return f"engram{g}." + ("tables" if leaf == "embedding" else leaf)
    if path.startswith(_HEADS):
        return f"{parts[0]}.{leaf}"
    return f"layer{layer:02d}.{leaf}" if layer is not None else leaf


def tensor_table(float_params: Mapping[str, Any], quant_params: Mapping[str, Any], cq: Mapping[str, tuple],
                 config: TransformerConfig) -> list[dict[str, Any]]:
    """Every CQ tensor (per layer slice of a stacked leaf): unit, bits, SQNR, relative error, in model order."""
    f_flat, q_flat = flatten_tree(float_params), flatten_tree(quant_params)
    stacked = {r.flax for r in FAMILY.table(config).rules if FAMILY.table(config).layers(r) is not None}
    rows = []
    for path, (bits, _) in cq.items():
        f, q = np.asarray(f_flat[path]), np.asarray(q_flat[path])
        slices = [(i, f[i], q[i]) for i in range(f.shape[0])] if path in stacked else [(None, f, q)]
        for i, w, qw in slices:
            w64 = np.asarray(w, np.float64)
            norm, err = float(np.linalg.norm(w64)), float(np.linalg.norm(w64 - qw))
            unit = unit_of(path, i)
            rows.append({"name": tensor_name(path, i), "param": path, "layer": unit, "bits": bits,
                         "sqnr_db": sqnr_db(w, qw), "rel_err": err / norm if norm else (0.0 if err == 0 else None),
                         "numel": int(np.size(w)), "logits_path": unit is not None})
    order = {u: k for k, u in enumerate(unit_order(config))}
    return sorted(rows, key=lambda r: order.get(r["layer"], len(order)))


@torch.no_grad()
def _swapped(model: SimpleAttentionNetwork, keys: Sequence[str], new: Mapping[str, np.ndarray],
             old: Mapping[str, np.ndarray], tokens: torch.Tensor) -> np.ndarray:
    """The float model's logits (quant off) with `keys` taken from `new`, then put back from `old`."""
    params = [model.get_parameter(k) for k in keys]
    try:
        for p, k in zip(params, keys, strict=True):
            p.copy_(torch.from_numpy(np.array(new[k])))
        return logits_of(model, tokens, False)
    finally:
        for p, k in zip(params, keys, strict=True):
            p.copy_(torch.from_numpy(np.array(old[k])))


def attribute(fmodel: SimpleAttentionNetwork, tokens: torch.Tensor, real: np.ndarray, f_logits: np.ndarray,
              f_params: Mapping[str, Any], q_params: Mapping[str, Any], f_caps: Mapping[str, np.ndarray],
              q_caps: Mapping[str, np.ndarray], per_tensor: Sequence[Mapping[str, Any]], config: TransformerConfig
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per unit: its weights alone quantized in the float model (quant off), and its output state's error in the
    judged model (everything quantized, deploy numerics on)."""
    f_state, q_state = flax_to_torch_numpy(f_params, config), flax_to_torch_numpy(q_params, config)
    where = torch_index(config)
    members: dict[str, list[str]] = {}
    for key, arr in q_state.items():
        unit = unit_of(*where[key])
        if unit is not None and not np.array_equal(arr, f_state[key]):
            members.setdefault(unit, []).append(key)
    weights_only = _swapped(fmodel, [k for ks in members.values() for k in ks], q_state, f_state, tokens)
    total = logit_figures(weights_only, f_logits, real)["kld"]["mean"]
    rows = []
    for unit in unit_order(config):
        keys = members.get(unit, [])
        figs = logit_figures(_swapped(fmodel, keys, q_state, f_state, tokens), f_logits, real) if keys else None
        tensors = [t for t in per_tensor if t["layer"] == unit]
        dbs = [t["sqnr_db"] for t in tensors if t["sqnr_db"] is not None]
        err = state_error(q_caps[unit], f_caps[unit], real) if unit in f_caps else {}
        kind = unit.rstrip("0123456789")
        index = int(unit[len(kind):]) if unit[len(kind):] else None
        rows.append({
            "layer": unit, "kind": kind, "index": index,
            "site_layer": config.engram_layers[index] if kind == "engram" else None,
            "tensors": [t["name"] for t in tensors], "bits": sorted({t["bits"] for t in tensors}),
            "other_params": [k for k in keys if tensor_name(*where[k]) not in {t["name"] for t in tensors}],
            "sqnr_db_min": min(dbs) if dbs else None,
            "kld_mean": figs["kld"]["mean"] if figs else 0.0, "kld_p99": figs["kld"]["p99"] if figs else 0.0,
            "kld_max": figs["kld"]["max"] if figs else 0.0,
            "kld_share": (figs["kld"]["mean"] if figs else 0.0) / total if total else None,
            "same_top1": figs["same_top1"] if figs else 1.0, "rms_dp": figs["rms_dp"] if figs else 0.0,
            "state": _STATE_WORDS.get(kind, unit),
            "state_rel_rms": err.get("rel_rms"), "state_max_abs": err.get("max_abs"), "state_cos": err.get("cos"),
        })
    summary = {"units": len(members), "weights_only_kld_mean": total,
               "units_kld_mean_sum": float(sum(r["kld_mean"] for r in rows)),
               "alone": "the unit's weights quantized in the float model, deploy numerics off",
               "state": "the unit's output in the judged model (all weights quantized, deploy numerics on) against "
                        "the float model's"}
    return rows, summary


_STATE_WORDS = {"embedding": "the embedding rows looked up (before ·√D)", "layer": "lanes after the layer",
                "engram": "the engram site's value", "final_norm": "final hidden (after final_norm)"}


# ----------------------------------------------------------------------------- per site and per rung


def site_table(fmodel, qmodel, tokens, real, f_logits, f_heads) -> list[dict[str, Any]]:
    """Sites switched on one at a time over the CQ weights (cumulative), and each alone over the float weights."""
    rows, prev = [], None
    for k, site in enumerate(("weights", *SITES)):
        on = SITES[:k]
        cum = logit_figures(logits_of(qmodel, tokens, bool(on), on), f_logits, real)
        alone = None
        if site != "weights":
            alone = _short(logit_figures(logits_of(fmodel, tokens, True, (site,)), f_logits, real))
        row = {"site": site, "title": SITE_TITLES[site], "sites_on": list(on), "cumulative": _short(cum),
               "kld_mean_added": cum["kld"]["mean"] - (prev if prev is not None else 0.0), "alone": alone}
        if f_heads:
            row["heads"] = head_figures(head_outputs(qmodel, tokens, bool(on), on), f_heads)
        rows.append(row)
        prev = cum["kld"]["mean"]
    return rows


def rung_table(models: Mapping[str, SimpleAttentionNetwork], tokens, real, f_logits, depths: Sequence[int],
               config: TransformerConfig) -> list[dict[str, Any]]:
    """Each rung's logits against the full float model: the float rung, and each quantized model's rung (deploy
    numerics on); quant_cost is each quantized rung against the float rung."""
    rows = []
    for d in depths:
        float_rung = logits_of(models["float"], tokens, False, depth=d)
        row = {"depth": d, "layers": list(ladder_layer_indices(config, d)) if d < config.num_layers
               else list(range(config.num_layers)), "float": _short(logit_figures(float_rung, f_logits, real))}
        for name, model in models.items():
            if name != "float":
                q = logits_of(model, tokens, True, depth=d)
                row[name] = _short(logit_figures(q, f_logits, real))
                row[f"{name}_quant_cost"] = _short(logit_figures(q, float_rung, real))
        rows.append(row)
    return rows


def parse_depth(depth: str | None, config: TransformerConfig) -> list[int]:
    """`--depth all` (2..L), `--depth 4` or `--depth 2,4,8`; L is the full model."""
    if depth is None:
        return []
    L = config.num_layers
    if depth.strip() == "all":
        return list(range(2, L + 1))
    try:
        ds = sorted({int(x) for x in depth.split(",")})
    except ValueError:
        raise ConfigError(f"--depth {depth!r}: give 'all' or depths such as 2,4 (2 to {L})") from None
    bad = [d for d in ds if not 2 <= d <= L]
    if bad:
        raise ConfigError(f"--depth {bad[0]} is outside the ladder: rungs run from 2 to num_layers={L}")
    return ds


# ----------------------------------------------------------------------------- the report


def compare(float_params: Mapping[str, Any], config: TransformerConfig, batch: Batch, *, cact: CactTree | None = None,
            bits: float = 4, steps: int = DEFAULT_STEPS, depths: Sequence[int] = (), device: str = "cpu",
            thresholds: Thresholds = Thresholds(), model_info: Mapping[str, Any] | None = None,
            lora_info: Mapping[str, Any] | None = None, cq_check: dict[str, Any] | None = None) -> QuantReport:
    """The float model against upstream's deploy fake-quant and (given) the `.cact`; the judged report. The judged
    model (headline figures, greedy, per layer, per tensor) is the `.cact` when given, else the fake-quant."""
    dev = quant_device(device)
    config = dataclasses.replace(config, dtype="float32")
    pad = config.pad_token_id
    tokens_np = np.asarray(batch.tokens)
    real = tokens_np != pad
    fake = fake_quant_tree(float_params, bits)
    cq_fake = {p: (bits, groups_along_input(p)) for p, a in flatten_tree(float_params).items()
               if is_quant_leaf(p, np.ndim(a))}
    notes = list(cact.notes) if cact else []
    with pinned_torch():
        tokens = torch.from_numpy(tokens_np).long().to(dev)
        models = {"float": build_model(float_params, config, dev), "fake_quant": build_model(fake, config, dev)}
        if cact is not None:
            models["cact"] = build_model(cact.params, config, dev)
        judged = "cact" if cact is not None else "fake_quant"
        f_logits, f_caps = states_of(models["float"], tokens, False)
        j_logits, j_caps = states_of(models[judged], tokens, True)
        deploy = {"judged": judged, "models": {}}
        fake_logits = j_logits if judged == "fake_quant" else logits_of(models["fake_quant"], tokens, True)
        deploy["models"]["fake_quant"] = {
            "what": f"cq_quantize_params(params, {bits:g}) (the forward of upstream's cq_ste_params) + quant=True",
            **_short(logit_figures(fake_logits, f_logits, real))}
        if cact is not None:
            deploy["models"]["cact"] = {"what": "the .cact as read (read_export's tree) + quant=True",
                                        **_short(logit_figures(j_logits, f_logits, real))}
            deploy["models"]["cact_weights_only"] = {
                "what": "the .cact as read, deploy numerics off",
                **_short(logit_figures(logits_of(models["cact"], tokens, False), f_logits, real))}
            deploy["models"]["cact_vs_fake_quant"] = {
                "what": "the .cact (quant=True) against the fake-quant, as the reference",
                **_short(logit_figures(j_logits, fake_logits, real))}
        figures = logit_figures(j_logits, f_logits, real)
        judged_params = cact.params if cact is not None else fake
        per_tensor = tensor_table(float_params, judged_params, cact.cq if cact is not None else cq_fake, config)
        per_layer, attribution = attribute(models["float"], tokens, real, f_logits, float_params, judged_params,
                                           f_caps, j_caps, per_tensor, config)
        f_heads = head_outputs(models["float"], tokens, False)
        per_site = site_table(models["float"], models["fake_quant"], tokens, real, f_logits, f_heads)
        per_rung = rung_table(models, tokens, real, f_logits, depths, config) if depths else None
        greedy, arrays = None, {}
        if steps:
            ends = prompt_ends(tokens_np, pad)
            rows = np.flatnonzero(ends > 0)
            f_gen = greedy_decode(lambda t: logits_of(models["float"], t, False), tokens_np[rows], pad, steps, dev)
            q_gen = greedy_decode(lambda t: logits_of(models[judged], t, True), tokens_np[rows], pad, steps, dev)
            greedy = greedy_figures(f_gen, q_gen, rows)
            arrays.update(float_tokens=f_gen, quant_tokens=q_gen)
            if int(ends.max()) + steps > config.max_seq_len:
                notes.append(f"greedy decoding reaches {int(ends.max()) + steps} positions, past config.max_seq_len="
                             f"{config.max_seq_len} (upstream's forward does not check it)")
    if cact is not None and cq_check is None:
        cq_check = cq_check_section(float_params, cact)
    arrays.update(tokens=tokens_np, real=real, float_logits=f_logits, quant_logits=j_logits,
                  fake_quant_logits=fake_logits, float_states=f_caps, quant_states=j_caps)
    quantized = dict(cact.description) if cact is not None else {
        "source": "bits", "bits": f"{bits:g}", "call": f"cq_quantize_params(params, {bits:g}) + quant=True"}
    quantized["deploy"] = {"act_bits": config.act_bits, "kv_bits": config.kv_bits,
                           "sites": list(SITES), "head_bits": 4}
    if lora_info is not None:
        quantized["lora"] = dict(lora_info)
    report = QuantReport(
        quantized=quantized, positions={"real": int(real.sum()), "total": int(real.size)},
        kld=figures["kld"], same_top1=figures["same_top1"], top5=figures["top5"], rms_dp=figures["rms_dp"],
        logits_max_rel=figures["logits_max_rel"], greedy=greedy, per_layer=per_layer, per_tensor=per_tensor,
        attribution=attribution,
        inputs={**batch.describe(pad), "mask": "causal (upstream's __call__ default)",
                "counted": "real (non-pad) positions only"},
        model={**dict(model_info or {}), "family": "v3", "config": config.to_dict(),
               "num_params": int(sum(np.size(a) for a in flatten_tree(float_params).values()))},
        environment=environment(dev, "float32"), notes=notes, arrays=arrays,
        deploy=deploy, per_site=per_site, per_rung=per_rung, cq_check=cq_check)
    return score(report, thresholds)


def cq_check_section(float_params: Mapping[str, Any], cact: CactTree) -> dict[str, Any]:
    """The `.cact`'s CQ records against this project's CQ of the float weights, group by group (cq_flips); a file
    whose groups mostly differ beyond rounding flips was built from other weights: refused."""
    f_flat, c_flat = flatten_tree(float_params), flatten_tree(cact.params)
    comparisons = []
    for path, (bits, along) in cact.cq.items():
        w = cq_flips.group_view(f_flat[path], along)
        comparisons.append(cq_flips.compare_cq(w, cq_quantize(w, bits), cq_flips.group_view(c_flat[path], along),
                                               bits, name=path))
    section = refuse_foreign_cact(cq_flips.summarize(comparisons, CQ_CHECK_REL), cact.description["cact"])
    section["what"] = ("each CQ record of the .cact against cq_quantize of the checkpoint's float weights (this "
                       "project's), group by group: flips are groups one rounding step apart within float32 noise")
    return section


def parse_bits(bits: str | None) -> float:
    if bits is None:
        return 4.0
    try:
        value = float(bits)
    except ValueError:
        value = None
    if value not in (1.0, 2.0, 3.0, 4.0):
        raise ConfigError(f"--bits {bits!r}: Needle 3's CQ takes a width of 1, 2, 3 or 4 (upstream builds 4); Needle "
                          "3 has no bits maps")
    return value


def quant(float_ckpt: str, *, cact: str | None = None, bits: str | None = None, inputs: Any = None,
          batch: int = DEFAULT_BATCH, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, steps: int = DEFAULT_STEPS,
          depth: str | None = None, lora: str | None = None, json_path: str | None = None,
          html_path: str | None = None, force: bool = False, max_kld: float | None = None,
          min_top1: float | None = None, kld_stat: str = "mean", device: str = "cpu", ckpt: Any = None,
          dtype: str = "float32") -> QuantReport:
    """`needle-twin quant CKPT [--cact FILE] [--depth all] ...` on a Needle 3 checkpoint (`ckpt`: already read).
    Every argument is checked before a model runs; nothing is written on an error."""
    if dtype != "float32":
        raise NeedleTwinError("Needle 3's quant report runs float32 only (its deploy numerics are float32); drop "
                              "--dtype")
    thresholds = Thresholds(max_kld, min_top1, kld_stat)
    if cact is not None and bits is not None:
        raise NeedleTwinError("give --cact FILE or --bits WIDTH, not both: a .cact carries its own width")
    width = parse_bits(bits)
    if steps < 0:
        raise NeedleTwinError(f"--steps must be >= 0, got {steps}")
    quant_device(device)
    for option, path in (("FLOAT_CKPT", float_ckpt), ("--cact", cact), ("--inputs", inputs), ("--lora", lora)):
        if isinstance(path, (str, os.PathLike)) and not Path(path).exists():
            raise NeedleTwinError(f"{option} {path}: no such file")
    check_outputs((json_path, html_path), force)
    ckpt = ckpt if ckpt is not None else read_checkpoint(float_ckpt)
    if not isinstance(ckpt.config, TransformerConfig):
        raise NeedleTwinError(f"{float_ckpt} is a {ckpt.family.title} checkpoint, not Needle 3")
    config = ckpt.config
    depths = parse_depth(depth, config)
    params32 = widen(ckpt.params)
    lora_info = None
    if lora is not None:
        adapter = read_adapter(lora)
        check_adapter(adapter, params32, config)
        params32 = widen(merged_params(adapter, params32))
        lora_info = {"path": str(lora), "merge": "merge_lora(params, lora, scale) into the float tree before "
                                                 "quantizing (upstream's `needle build --lora`)"}
    data = quant_batch(config, inputs=inputs, batch=batch, seq_len=seq_len, seed=seed)
    cact_tree = section = None
    if cact is not None:
        cact_tree = read_cact_tree(cact, config, params32)
        section = cq_check_section(params32, cact_tree)  # refuses a .cact of other weights before any model runs
        width = cact_tree.weight_bits  # the fake-quant at the file's width, so the three-way table compares alike
    report = compare(params32, config, data, cact=cact_tree, bits=width, steps=steps, depths=depths, device=device,
                     thresholds=thresholds, lora_info=lora_info, cq_check=section,
                     model_info={"checkpoint": str(float_ckpt), "format": ckpt.format, "step": ckpt.extra.get("step")})
    write_outputs(report, ((json_path, to_json), (html_path, render_html)), force)
    return report


__all__ = ["SITES", "CactTree", "compare", "cq_check_section", "deploy_sites", "fake_quant_tree", "logits_of",
           "parse_depth", "quant", "quant_batch", "read_cact_tree"]
