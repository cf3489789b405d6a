"""Quantization parity for Needle 2: does a 2- or 4-bit model still decide what the float model decided, and which
layers and tensors does the quantization damage? Torch only (no JAX).

The quantized model is either a `.cact` file's dequantized tree (`convert.v2.cact.to_params`) or
upstream's CQ fake-quant of the float tree for a bits spec (`convert.v2.cq.cq_mixed_params`: "4",
"2", "1.58" or a map such as "default=2,embedding=4,attn.q_proj=3"). Both models run the same
inputs with upstream's forward (causal mask only, `__call__`'s default: with right padding no real
position ever sees a pad), and every figure counts real (non-pad) positions only:

- KL(p_float ‖ p_quant) per real position (mean ± standard error, median, p99, p99.9, max), the
  same-top-1 rate and the RMS of Δp, the probability the quantized model gives the float model's
  top token minus the float model's own;
- greedy decoding of both models from the same prompts (a plain recompute loop);
- per attribution unit (the embedding, each layer's attention projections and lane routing φ, each
  engram site), the KL of the final logits when only that unit is quantized (the rest float), and
  the error of that unit's output state when everything is quantized (the lanes after a layer
  through its `tap_state`);
- per CQ tensor, its SQNR 10·log10(‖w‖² / ‖w − q(w)‖²) and its bits.

Shapes: B batch, T length, V vocab, D d_model, n lanes, G engram sites, L layers, R positions.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convert.errors import CheckpointError, ConfigError, NeedleTwinError
from convert.io import read_checkpoint
from convert.mapping import flax_to_torch_numpy
from convert.safe_pickle import load_file
from convert.trees import flatten_tree, unflatten_tree
from convert.v2 import FAMILY
from convert.v2.bits import (
    Bits,
    bits_for,
    canonical_name,
    check_bits,
    format_bits_map,
    groups_along_input,
    parse_bits_map,
    unused_keys,
)
from convert.v2.cact import CQ, CactFile, read_cact, to_params
from convert.v2.config import TransformerConfig
from convert.v2.cq import cq_mixed_params, quant_leaf_names, width_of_record
from convert.v2.lora import merge_lora
from needle_torch.layers import TORCH_DTYPES
from needle_torch.v2 import SimpleAttentionNetwork
from parity_tests import cq_flips
from parity_tests.inputs import Batch, InputError, as_token_array, check_sizes, check_tokens
from parity_tests.outputs import check_outputs, write_outputs
from parity_tests.quant import (
    environment,
    greedy_decode,
    greedy_figures,
    kld_stats,
    logit_figures,
    pinned_torch,
    prompt_ends,
    quant_device,
    refuse_foreign_cact,
    rescore_file,
    sqnr_db,
    state_error,
)
from parity_tests.quant import torch_index as family_torch_index
from parity_tests.quant_report import (
    QuantReport,
    ReportError,
    Thresholds,
    load_json,
    render_html,
    render_terminal,
    rescore,
    score,
    to_json,
)
from parity_tests.v2 import inputs as v2_inputs

DEFAULT_BATCH, DEFAULT_SEQ_LEN, DEFAULT_STEPS = 4, 32, 8
CQ_CHECK_REL = 1e-5  # the project's float32 budget for a CQ group both builds quantised alike
LOGITS_PATH = ("embedding/", "stack/", "engrams_")  # Flax prefixes the LM logits depend on (not MTP, not the heads)
_ENGRAM = re.compile(r"engrams_(\d+)/")


# ----------------------------------------------------------------------------- inputs


def quant_batch(config: TransformerConfig, *, inputs: Any = None, batch: int = DEFAULT_BATCH,
                seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0) -> Batch:
    """The run's tokens: a token file (.npy, .npz or .json with a `tokens` array, as `needle-twin parity --inputs`
    takes), an array or a list of id rows (e.g. text through a tokenizer; ragged rows are right-padded), or
    (None) a seeded random batch: BOS, then ordinary ids, row 0 full length, the others right-padded to varied
    lengths. batch and seq_len size the random batch only."""
    pad = config.pad_token_id
    if inputs is None:
        return v2_inputs.random_batch(config, batch, seq_len, seed)  # the same tokens `needle-twin parity` draws
    if isinstance(inputs, (str, os.PathLike)):
        given = v2_inputs.load_token_file(inputs, config)
        tokens, source = given.tokens, given.source
    else:
        tokens = check_tokens(as_token_array(inputs, "tokens", pad), config.vocab_size, "tokens")
        source = "given ids"
    if not (tokens != pad).any():
        raise InputError(f"tokens hold only the pad id {pad}: there is no real position to compare; give some "
                         "real token ids")
    return Batch({"tokens": tokens}, source)


# ----------------------------------------------------------------------------- bits specs and LoRA


def parse_bits_spec(spec: Any) -> tuple[dict[str, Bits], Bits]:
    """`--bits SPEC` -> (bits map, default): a width ("4", "2", "3", "1.58", or the number) or a bits map such as
    "default=2,embedding=4,attn.q_proj=3" (upstream's `weight_bits` syntax)."""
    if isinstance(spec, str) and "=" in spec:
        return parse_bits_map(spec)
    if isinstance(spec, str):
        try:
            spec = float(spec.strip())
        except ValueError:
            raise ConfigError(f"--bits {spec!r} is neither a width (2, 3, 4, 1.58) nor a bits map such as "
                              "'default=2,embedding=4,attn.q_proj=3'") from None
    return {}, check_bits(spec, "--bits")


def load_adapter(lora: Any) -> tuple[dict[str, Any], float, dict[str, Any]]:
    """(targets {flax path: {"A", "B"}}, scale, report info) from an adapter pickle path or its loaded dict."""
    if isinstance(lora, (str, os.PathLike)):
        if not Path(lora).is_file():
            raise CheckpointError(f"--lora {lora}: no such file; give the adapter pickle `needle finetune` wrote")
        obj, where = load_file(lora), str(lora)
    else:
        obj, where = lora, None
    if not isinstance(obj, Mapping) or not isinstance(obj.get("lora"), Mapping) or "scale" not in obj:
        raise CheckpointError(f"--lora {where or '(given object)'} is not a LoRA adapter: expected "
                              '{"lora": {path: {"A", "B"}}, "scale": float, ...}, as `needle finetune` writes')
    info = {"path": where, "scale": float(obj["scale"]), "rank": obj.get("rank"), "targets": sorted(obj["lora"]),
            "merge": "W + cast_W.dtype(scale * A @ B) into the float tree as given, before quantizing "
                     "(upstream's `needle build --lora`)"}
    return dict(obj["lora"]), float(obj["scale"]), info


def merge_adapter(params: Mapping[str, Any], targets: Mapping[str, Any], scale: float) -> dict[str, Any]:
    """merge_lora after checking every target exists with the shapes its A (L, in, r) and B (L, r, out) need."""
    flat = flatten_tree(params)
    for path, ab in targets.items():
        if path not in flat:
            raise CheckpointError(f"LoRA target {path!r} is not in the checkpoint; give the adapter trained on it")
        w = np.shape(flat[path])
        try:
            a, b = np.shape(ab["A"]), np.shape(ab["B"])
        except (KeyError, TypeError):
            raise CheckpointError(f"LoRA target {path!r} lacks its A and B matrices; the adapter is damaged") \
                from None
        if len(a) != len(w) or len(b) != len(w) or a[:-1] != w[:-1] or b[-1] != w[-1] or a[-1] != b[-2]:
            raise CheckpointError(f"LoRA target {path!r}: A {a} @ B {b} does not fit the weight {w}; give the "
                                  "adapter trained on this checkpoint")
    return merge_lora(params, targets, scale)


def widen(params: Mapping[str, Any]) -> dict[str, Any]:
    """Every leaf as float32 (exact for the float16 / bfloat16 checkpoints upstream stores)."""
    return unflatten_tree({k: np.asarray(v, np.float32) for k, v in flatten_tree(params).items()})


# ----------------------------------------------------------------------------- the quantized model


@dataclass(frozen=True)
class Quantized:
    """A quantized Flax tree (float32 leaves), which leaves are CQ, each CQ tensor's width, and what it is."""

    params: dict[str, Any]
    cq_paths: tuple[str, ...]  # Flax paths of the CQ-quantized leaves
    widths: dict[str, Bits]  # tensor name (e.g. layer03.q_proj) -> CQ width
    description: dict[str, Any]  # for the report's `quantized`
    notes: tuple[str, ...] = ()


def stacked_paths(config: TransformerConfig) -> set[str]:
    """Flax paths with a leading layer axis (the scanned block and the lane routing)."""
    table = FAMILY.table(config)
    return {r.flax for r in table.rules if table.layers(r) is not None}


def tensor_name(path: str, layer: int | None) -> str:
    """A tensor's name in the report: `.cact`-style, per layer (layer03.q_proj, layer03.mhc_phi_res,
    engram0.tables, embedding; off the logits path e.g. mtp.q_proj, contrastive_head.proj)."""
    name = canonical_name(path)
    return name if layer is None else f"layer{layer:02d}." + name.removeprefix("attn.")


def unit_of(path: str, layer: int | None) -> str | None:
    """The attribution unit a (Flax path, layer) belongs to: embedding, layerNN, engramG, or another stack leaf
    (final_norm); None off the logits path (MTP, probe heads)."""
    if path.startswith("embedding/"):
        return "embedding"
    if layer is not None:
        return f"layer{layer:02d}"
    m = _ENGRAM.match(path)
    if m:
        return f"engram{m[1]}"
    if path.startswith("stack/"):
        return path.split("/")[1]
    return None


def _slices(flat: Mapping[str, np.ndarray], path: str, stacked: set[str]) -> list[tuple[int | None, np.ndarray]]:
    a = np.asarray(flat[path])
    return [(i, a[i]) for i in range(a.shape[0])] if path in stacked else [(None, a)]


def quantize_bits(params32: Mapping[str, Any], config: TransformerConfig, spec: Any) -> Quantized:
    """Upstream's `cq_mixed_params` of the float tree for `--bits SPEC` (what `needle build` exports at it)."""
    bits_map, default = parse_bits_spec(spec)
    paths = tuple(quant_leaf_names(params32))
    stacked = stacked_paths(config)
    flat = flatten_tree(params32)
    widths = {tensor_name(p, i): bits_for(p, bits_map, default) for p in paths for i, _ in _slices(flat, p, stacked)}
    notes = []
    unused = unused_keys(bits_map, paths)
    if unused:
        notes.append(f"bits map key(s) {', '.join(unused)} match no tensor (a typo means 'default')")
    off_path = [tensor_name(p, None) for p in paths if not p.startswith(LOGITS_PATH)]
    if off_path:
        notes.append(f"{', '.join(off_path)} are CQ-quantized too, as upstream's cq_quantize_params does, but they "
                     "are off the logits path and not compared; a .cact drops the MTP head and stores the probe-head "
                     "projections as FP16")
    rounded = [p for p, a in flat.items() if p not in paths and p.startswith(LOGITS_PATH)
               and not np.array_equal(a, a.astype(np.float16).astype(np.float32))]
    if rounded:
        notes.append(f"{len(rounded)} non-CQ leaves on the logits path are kept as given here, but a .cact stores "
                     "them as FP16 and they are not fp16 values in this checkpoint: a .cact of it differs a little "
                     "more")
    description = {"source": "bits", "bits": str(spec), "bits_map": format_bits_map(bits_map, default) or "default=4",
                   "call": f"cq_mixed_params(params_f32, {bits_map!r}, {default})"}
    return Quantized(cq_mixed_params(params32, bits_map, default), paths, widths, description, tuple(notes))


_SAME_MODEL = ("vocab_size", "d_model", "attn_dim", "num_heads", "num_kv_heads", "num_layers", "mhc_lanes",
               "engram_orders", "engram_heads_resolved", "engram_slots", "engram_layers")


def from_cact(cact: str | os.PathLike | CactFile, config: TransformerConfig) -> Quantized:
    """The `.cact`'s dequantized tree (`to_params`), after checking its header describes the float model."""
    f = cact if isinstance(cact, CactFile) else read_cact(cact)
    params, cact_config, lossy = to_params(f)
    differ = {k: (getattr(cact_config, k), getattr(config, k)) for k in _SAME_MODEL
              if tuple(np.atleast_1d(getattr(cact_config, k))) != tuple(np.atleast_1d(getattr(config, k)))}
    if np.float32(cact_config.rope_theta) != np.float32(config.rope_theta):  # the header holds θ as float32
        differ["rope_theta"] = (cact_config.rope_theta, config.rope_theta)
    if differ:
        what = "; ".join(f"{k}: .cact {a!r} vs checkpoint {b!r}" for k, (a, b) in differ.items())
        raise ConfigError(f"{f.path} describes another model than the float checkpoint ({what}); give the .cact "
                          "exported from this checkpoint")
    stacked = stacked_paths(config)
    flat = flatten_tree(params)
    record_bits = {r.name: width_of_record(r.bits) for r in f.records if r.dtype == CQ}
    widths = {}
    for p in lossy.cq:
        for i, _ in _slices(flat, p, stacked):
            record = canonical_name(p) if p.startswith("stack/mhc_") else tensor_name(p, i)  # φ: one record, all L
            widths[tensor_name(p, i)] = record_bits[record]
    notes = (f"{f.path}: what a .cact cannot hold: " + "; ".join(lossy.lines()),
             "only the logits path is compared: the MTP head (absent from a .cact) and the probe heads are not")
    description = {"source": "cact", "cact": str(f.path), "bits_map": cact_config.weight_bits or "default=4",
                   "records": len(f.records), "lossy": lossy.lines()}
    return Quantized(params, tuple(lossy.cq), widths, description, notes)


def unquantized(params32: Mapping[str, Any]) -> Quantized:
    """The float tree itself as the 'quantized' model (a control: every figure must say 'identical')."""
    return Quantized(unflatten_tree(dict(flatten_tree(params32))), (), {}, {"source": "none"})


# ----------------------------------------------------------------------------- figures (numpy, float64)


# ----------------------------------------------------------------------------- running the models


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().cpu().numpy()


@torch.no_grad()
def forward_states(model: SimpleAttentionNetwork, tokens: torch.Tensor) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Logits (B, T, V) and the states the report compares, read through the model's Taps: embed (B, T, D),
    engram_v (G, B, T, D), state.{i} the lanes after layer i (B, T, n, D), final_hidden (B, T, D)."""
    caps: dict[str, np.ndarray] = {}

    def keep(name: str):
        def hook(module, args, output):
            caps[name] = _numpy(output)
        return hook

    taps = [("embed", model.tap_embed), ("engram_v", model.tap_engram_v), ("final_hidden", model.tap_final_hidden)]
    taps += [(f"state.{i}", layer.tap_state) for i, layer in enumerate(model.stack.layers)]
    handles = [tap.register_forward_hook(keep(name)) for name, tap in taps]
    try:
        logits = _numpy(model(tokens))
    finally:
        for h in handles:
            h.remove()
    return logits, caps


def _unit_order(config: TransformerConfig, units: Sequence[str]) -> list[str]:
    """Execution order: embedding, then each layer preceded by the engram sites it injects, then the rest."""
    order = ["embedding"]
    for i in range(config.num_layers):
        order += [f"engram{g}" for g, site in enumerate(config.engram_layers) if site == i]
        order.append(f"layer{i:02d}")
    return order + sorted(u for u in units if u not in order)


def _unit_kind(unit: str) -> tuple[str, int | None]:
    """("layer", 3) for layer03, ("engram", 0) for engram0, (name, None) otherwise."""
    m = re.fullmatch(r"(layer|engram)(\d+)", unit)
    return (m[1], int(m[2])) if m else (unit, None)


def _unit_state(unit: str, caps: Mapping[str, np.ndarray]) -> tuple[str, np.ndarray | None]:
    """What a unit's output state is, and its captured value (None: no capture point for it)."""
    kind, index = _unit_kind(unit)
    if kind == "embedding":
        return "x0 = embedding(tokens)·√D", caps["embed"]
    if kind == "layer":
        return f"lanes after layer {index}", caps[f"state.{index}"]
    if kind == "engram":
        return f"engram site {index} value", caps["engram_v"][index]
    if kind == "final_norm":
        return "final hidden (after final_norm)", caps["final_hidden"]
    return unit, None


def tensor_table(float_params: Mapping[str, Any], quantized: Quantized, config: TransformerConfig
                 ) -> list[dict[str, Any]]:
    """Every CQ tensor (per layer slice of a stacked leaf): its unit, bits, SQNR and relative error, model order."""
    stacked = stacked_paths(config)
    f_flat, q_flat = flatten_tree(float_params), flatten_tree(quantized.params)
    rows = []
    for path in quantized.cq_paths:
        for (i, w), (_, q) in zip(_slices(f_flat, path, stacked), _slices(q_flat, path, stacked), strict=True):
            name = tensor_name(path, i)
            w64 = np.asarray(w, np.float64)
            norm, err = float(np.linalg.norm(w64)), float(np.linalg.norm(w64 - q))
            rows.append({"name": name, "param": path, "layer": unit_of(path, i), "bits": quantized.widths.get(name),
                         "sqnr_db": sqnr_db(w, q), "rel_err": err / norm if norm else (0.0 if err == 0 else None),
                         "numel": int(np.size(w)), "logits_path": path.startswith(LOGITS_PATH)})
    order = {u: i for i, u in enumerate(_unit_order(config, [r["layer"] for r in rows if r["layer"]]))}
    return sorted(rows, key=lambda r: order.get(r["layer"], len(order)))  # stable: model order within a unit


def torch_index(config: TransformerConfig) -> dict[str, tuple[str, int | None]]:
    """torch state_dict name -> (Flax path, layer index or None), from the mapping rules."""
    return family_torch_index(FAMILY, config)


def unit_members(f_state: Mapping[str, np.ndarray], q_state: Mapping[str, np.ndarray], config: TransformerConfig
                 ) -> dict[str, list[str]]:
    """{unit: the torch names of its logits-path parameters that differ between the two state dicts}."""
    where = torch_index(config)
    members: dict[str, list[str]] = {}
    for key, arr in q_state.items():
        unit = unit_of(*where[key])
        if unit is not None and not np.array_equal(arr, f_state[key]):
            members.setdefault(unit, []).append(key)
    return members


@dataclass(frozen=True)
class _Run:
    """One batch through both models: what the attribution compares against."""

    model: SimpleAttentionNetwork  # the float model, whose parameters the attribution swaps
    tokens: torch.Tensor
    real: np.ndarray  # (B, T) bool
    float_logits: np.ndarray
    quant_logits: np.ndarray
    float_caps: dict[str, np.ndarray]
    quant_caps: dict[str, np.ndarray]


def attribute(run: _Run, f_state: Mapping[str, np.ndarray], q_state: Mapping[str, np.ndarray],
              per_tensor: Sequence[Mapping[str, Any]], widths: Mapping[str, Bits], config: TransformerConfig
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(per_layer rows, attribution summary): each unit's changed parameters swapped into the float model alone,
    then every unit at once (which must give the quantized model's logits exactly)."""
    members = unit_members(f_state, q_state, config)
    where = torch_index(config)
    cq_names = {t["name"] for t in per_tensor}
    total = logit_figures(run.quant_logits, run.float_logits, run.real)["kld"]["mean"]
    rows, swapped = [], []
    for unit in _unit_order(config, list(members)):
        keys = members.get(unit, [])
        if keys:
            figs = logit_figures(_with_swapped(run.model, keys, q_state, f_state, run.tokens), run.float_logits,
                                 run.real)
            swapped += keys
        else:  # nothing of it differs: exactly the float model
            figs = {"kld": {"mean": 0.0, "p99": 0.0, "max": 0.0}, "same_top1": 1.0, "rms_dp": 0.0}
        tensors = [t for t in per_tensor if t["layer"] == unit]
        dbs = [t["sqnr_db"] for t in tensors if t["sqnr_db"] is not None]
        what, f_s = _unit_state(unit, run.float_caps)
        err = state_error(_unit_state(unit, run.quant_caps)[1], f_s, run.real) if f_s is not None else {}
        kind, index = _unit_kind(unit)
        rows.append({
            "layer": unit, "kind": kind, "index": index,
            "site_layer": config.engram_layers[index] if kind == "engram" else None,
            "tensors": [t["name"] for t in tensors], "bits": sorted({widths[t["name"]] for t in tensors}),
            "other_params": [k for k in keys if tensor_name(*where[k]) not in cq_names],
            "sqnr_db_min": min(dbs) if dbs else None,
            "kld_mean": figs["kld"]["mean"], "kld_p99": figs["kld"]["p99"], "kld_max": figs["kld"]["max"],
            "kld_share": figs["kld"]["mean"] / total if total else None,
            "same_top1": figs["same_top1"], "rms_dp": figs["rms_dp"],
            "state": what, "state_rel_rms": err.get("rel_rms"), "state_max_abs": err.get("max_abs"),
            "state_cos": err.get("cos"),
        })
    every = _with_swapped(run.model, swapped, q_state, f_state, run.tokens) if swapped else run.float_logits
    summary = {"units": len(members), "all_units_vs_quantized_max_abs": float(np.max(np.abs(every - run.quant_logits))),
               "units_kld_mean_sum": float(sum(r["kld_mean"] for r in rows))}
    return rows, summary


def compare(float_params: Mapping[str, Any], quantized: Quantized, config: TransformerConfig, batch: Batch, *,
            steps: int = DEFAULT_STEPS, device: str = "cpu", dtype: str = "float32",
            thresholds: Thresholds = Thresholds(), model_info: Mapping[str, Any] | None = None,
            cq_check: dict[str, Any] | None = None) -> QuantReport:
    """The float model (float32 Flax tree) against `quantized` on `batch`; the judged report (see the module doc),
    with `cq_check` (a .cact's CQ against this checkpoint's) judged too.

    Attribution: a unit is every logits-path parameter of one layer (or of the embedding, an engram site, ...)
    that differs between the two trees; "alone" means the float model with only those tensors swapped in.
    A unit none of whose tensors differ is not re-run: its figures are exactly 0 (KL) and 1 (top-1)."""
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    if steps < 0:
        raise NeedleTwinError(f"--steps must be >= 0, got {steps}")
    dev = quant_device(device)
    pad = config.pad_token_id
    tokens_np = np.asarray(batch.tokens)
    real = tokens_np != pad  # (B, T)
    notes = list(quantized.notes)
    with pinned_torch():
        fmodel = _owned(SimpleAttentionNetwork.from_flax(float_params, config, dtype=dtype).to(dev))
        qmodel = _owned(SimpleAttentionNetwork.from_flax(quantized.params, config, dtype=dtype).to(dev))
        tokens = torch.from_numpy(tokens_np).long().to(dev)
        f_logits, f_caps = forward_states(fmodel, tokens)
        q_logits, q_caps = forward_states(qmodel, tokens)
        run = _Run(fmodel, tokens, real, f_logits, q_logits, f_caps, q_caps)
        figures = logit_figures(run.quant_logits, run.float_logits, real)
        per_tensor = tensor_table(float_params, quantized, config)
        per_layer, attribution = attribute(run, flax_to_torch_numpy(float_params, config),
                                           flax_to_torch_numpy(quantized.params, config), per_tensor,
                                           quantized.widths, config)
        greedy, arrays = None, {}
        if steps:
            ends = prompt_ends(tokens_np, pad)
            rows = np.flatnonzero(ends > 0)
            f_gen = greedy_decode(lambda t: _numpy(fmodel(t)), tokens_np[rows], pad, steps, dev)
            q_gen = greedy_decode(lambda t: _numpy(qmodel(t)), tokens_np[rows], pad, steps, dev)
            greedy = greedy_figures(f_gen, q_gen, rows)
            arrays.update(float_tokens=f_gen, quant_tokens=q_gen)
            if int(ends.max()) + steps > config.max_seq_len:
                notes.append(f"greedy decoding reaches {int(ends.max()) + steps} positions, past config.max_seq_len="
                             f"{config.max_seq_len} (upstream's forward does not check it)")
    arrays.update(tokens=tokens_np, real=real, float_logits=run.float_logits, quant_logits=run.quant_logits,
                  float_states=run.float_caps, quant_states=run.quant_caps)
    report = QuantReport(
        quantized=dict(quantized.description),
        positions={"real": int(real.sum()), "total": int(real.size)},
        kld=figures["kld"], same_top1=figures["same_top1"], top5=figures["top5"], rms_dp=figures["rms_dp"],
        logits_max_rel=figures["logits_max_rel"], greedy=greedy, per_layer=per_layer, per_tensor=per_tensor,
        attribution=attribution,
        inputs={**batch.describe(pad), "mask": "causal (upstream's __call__ default)",
                "counted": "real (non-pad) positions only"},
        model={**dict(model_info or {}), "config": config.to_dict(),
               "num_params": int(sum(np.size(a) for a in flatten_tree(float_params).values()))},
        environment=environment(dev, dtype), notes=notes, arrays=arrays, cq_check=cq_check)
    return score(report, thresholds)


def _owned(model: SimpleAttentionNetwork) -> SimpleAttentionNetwork:
    """The model with parameters of its own: from_flax may share memory with the numpy tree it was given, and
    the attribution writes into the float model's parameters, which must never reach the caller's arrays."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model


def _with_swapped(model: SimpleAttentionNetwork, keys: Sequence[str], new: Mapping[str, np.ndarray],
                  old: Mapping[str, np.ndarray], tokens: torch.Tensor) -> np.ndarray:
    """The model's logits with `keys` taken from `new`, then put back from `old` (copy_ casts to the model dtype,
    rounding as from_flax's cast does)."""
    params = [model.get_parameter(k) for k in keys]
    try:
        with torch.no_grad():
            for p, k in zip(params, keys, strict=True):
                p.copy_(torch.from_numpy(np.array(new[k])))  # a copy; 0-d stays 0-d
            return _numpy(model(tokens))
    finally:
        with torch.no_grad():
            for p, k in zip(params, keys, strict=True):
                p.copy_(torch.from_numpy(np.array(old[k])))


def run_quant(float_params: Mapping[str, Any], config: TransformerConfig, *, cact: Any = None, bits: Any = None,
              inputs: Any = None, seq_len: int = DEFAULT_SEQ_LEN, batch: int = DEFAULT_BATCH, seed: int = 0,
              steps: int = DEFAULT_STEPS, lora: Any = None, device: str = "cpu", dtype: str = "float32",
              max_kld: float | None = None, min_top1: float | None = None, kld_stat: str = "mean",
              model_info: Mapping[str, Any] | None = None) -> QuantReport:
    """Float model vs its quantized twin on the same inputs; the judged QuantReport.

    cact: a `.cact` path (or read_cact's CactFile) exported from this checkpoint; bits: "4", "2", "1.58" or a
    bits map (exactly one of the two). inputs: see `quant_batch` (None: seeded random, batch × seq_len).
    lora: an adapter pickle path or its dict, merged into the float tree first (as `needle build --lora`
    does; with a .cact, give the adapter it was built with). max_kld / min_top1: the verdict's thresholds."""
    thresholds = Thresholds(max_kld, min_top1, kld_stat)
    if not isinstance(config, TransformerConfig):
        raise ConfigError(f"quantization parity is for Needle 2 (.cact, CQ) checkpoints; this is a "
                          f"{type(config).__module__}.{type(config).__name__}")
    if (cact is None) == (bits is None):
        raise NeedleTwinError("give exactly one of --cact FILE or --bits SPEC")
    lora_info = None
    if lora is not None:
        targets, scale, lora_info = load_adapter(lora)
        float_params = merge_adapter(float_params, targets, scale)
    params32 = widen(float_params)
    quantized = from_cact(cact, config) if cact is not None else quantize_bits(params32, config, bits)
    if lora_info is not None:
        notes = quantized.notes + (("the float model is base + adapter; the .cact must have been built with the "
                                    "same adapter (`needle build --lora`)",) if cact is not None else ())
        quantized = dataclasses.replace(quantized, description={**quantized.description, "lora": lora_info},
                                        notes=notes)
    data = quant_batch(config, inputs=inputs, batch=batch, seq_len=seq_len, seed=seed)
    # a .cact of other weights is refused before any model runs
    check = None if cact is None else cq_check(params32, quantized, config)
    return compare(params32, quantized, config, data, steps=steps, device=device, dtype=dtype,
                   thresholds=thresholds, model_info=model_info, cq_check=check)


def cq_check(params32: Mapping[str, Any], quantized: Quantized, config: TransformerConfig) -> dict[str, Any]:
    """The .cact's CQ leaves against this project's CQ of the float weights at the file's widths, group by group,
    rounding flips told from real differences (parity_tests/cq_flips.py); a file most of whose groups differ was
    exported from other weights: refused."""
    ours = flatten_tree(quantize_bits(params32, config, quantized.description["bits_map"]).params)
    stacked = stacked_paths(config)
    leaves = {p: (quantized.widths[tensor_name(p, 0 if p in stacked else None)], groups_along_input(p))
              for p in quantized.cq_paths}
    section = refuse_foreign_cact(cq_flips.summarize(cq_flips.compare_trees(
        flatten_tree(params32), ours, flatten_tree(quantized.params), leaves), CQ_CHECK_REL),
        quantized.description.get("cact"))
    section["what"] = ("each CQ record of the .cact against cq_quantize of the checkpoint's float weights (this "
                       "project's), group by group: flips are groups one rounding step apart within float32 noise")
    return section


# ----------------------------------------------------------------------------- the command


def quant(float_ckpt: str, *, cact: str | None = None, bits: str | None = None, inputs: str | None = None,
          batch: int = DEFAULT_BATCH, seq_len: int = DEFAULT_SEQ_LEN, seed: int = 0, steps: int = DEFAULT_STEPS,
          lora: str | None = None, json_path: str | None = None, html_path: str | None = None, force: bool = False,
          max_kld: float | None = None, min_top1: float | None = None, kld_stat: str = "mean", device: str = "cpu",
          dtype: str = "float32", depth: str | None = None) -> QuantReport:
    """`needle-twin quant FLOAT_CKPT (--cact FILE | --bits SPEC) ...`: check the arguments (no model is read
    before they pass), read the checkpoint, run, write the requested files; returns the judged report (exit
    code: report.exit_code, 1 when a threshold fails)."""
    if depth is not None:
        raise NeedleTwinError("--depth judges Needle 3 ladder rungs; this checkpoint is not Needle 3")
    if (cact is None) == (bits is None):
        raise NeedleTwinError("give exactly one of --cact FILE or --bits SPEC")
    if bits is not None:
        parse_bits_spec(bits)
    Thresholds(max_kld, min_top1, kld_stat)
    if dtype not in TORCH_DTYPES:
        raise NeedleTwinError(f"--dtype {dtype!r} is not one of {', '.join(TORCH_DTYPES)}")
    quant_device(device)
    if steps < 0:
        raise NeedleTwinError(f"--steps must be >= 0, got {steps}")
    if inputs is None:
        check_sizes(batch=batch, seq_len=seq_len)
    for option, path in (("FLOAT_CKPT", float_ckpt), ("--cact", cact), ("--inputs", inputs), ("--lora", lora)):
        if path is not None and not Path(path).exists():
            raise NeedleTwinError(f"{option} {path}: no such file")
    check_outputs((json_path, html_path), force)
    ckpt = read_checkpoint(float_ckpt)
    if not isinstance(ckpt.config, TransformerConfig):
        raise NeedleTwinError(f"{float_ckpt} is a {ckpt.family.title} checkpoint; quantization parity is for "
                              "Needle 2 and Needle 3 (.cact / CQ): give one of theirs")
    report = run_quant(ckpt.params, ckpt.config, cact=cact, bits=bits, inputs=inputs, seq_len=seq_len, batch=batch,
                       seed=seed, steps=steps, lora=lora, device=device, dtype=dtype, max_kld=max_kld,
                       min_top1=min_top1, kld_stat=kld_stat,
                       model_info={"checkpoint": str(float_ckpt), "format": ckpt.format,
                                   "step": ckpt.extra.get("step")})
    write_outputs(report, ((json_path, to_json), (html_path, render_html)), force)
    return report


__all__ = [
    "QuantReport", "Quantized", "ReportError", "Thresholds", "attribute", "compare", "forward_states", "from_cact",
    "kld_stats", "load_json", "logit_figures", "parse_bits_spec", "quant", "quant_batch",
    "quantize_bits", "render_html", "render_terminal", "rescore", "rescore_file", "run_quant", "score", "sqnr_db",
    "state_error", "tensor_table", "to_json", "torch_index", "unit_members", "unquantized",
]
