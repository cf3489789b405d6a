"""Needle 2 LoRA adapters (`needle finetune`, NEEDLE_V2.md §7.2): upstream's merge rule and files, and PEFT's.

An adapter is {"lora": {flax path: {"A": (L, in, r), "B": (L, r, out)}}, "scale": alpha / rank,
"base": base checkpoint path, "rank": r}; from 2.0.15 on (NEEDLE_V3.md §13 item 3) it also holds "qat_bits"
(int or None), "qat_bits_map" (str or None) and "seed" (int), which 2.0.8's lack (read as None).
Upstream merges W' = W + cast_{W.dtype}(scale * (A @ B)): the product in float32, batched over the layer
axis, cast to W's dtype before the addition, so the sum happens in W's dtype (float16 when `needle build`
merges into a float16 checkpoint).

PEFT holds the same adapter as one (lora_A, lora_B) pair of Linear weights per adapted module of
the torch twin: lora_A.weight (r, in) = A[i]ᵀ, lora_B.weight (out, r) = B[i]ᵀ, and it scales by
lora_alpha / r, so lora_alpha = scale · rank. Its files are an adapter directory holding
`adapter_model.safetensors` and `adapter_config.json`. Everything here is numpy and JSON: no
torch, no peft (needle_torch.v2.peft has the live-model side).

Shapes: L layers, in/out the kernel's (in, out) widths, r rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from convert.atomic import atomic_output
from convert.errors import CheckpointError, ConfigError
from convert.formats import safetensors_format
from convert.plan import Planned
from convert.safe_pickle import load_file
from convert.tensors import dtype_name, is_finite
from convert.trees import flatten_tree, unflatten_tree
from convert.v2.bits import parse_bits_map
from convert.v2.config import TransformerConfig
from convert.v2.mapping import block, dims

# upstream's `lora_target_paths` (§7.2): the main stack's attention kernels, never mtp_block's or the engrams'.
# Their torch names come from the mapping's own rules, so the PEFT keys follow the twin's state_dict.
_RULES = {r.flax: r for r in block("stack/layers/block", "stack.layers.{i}.block", "L", None)}
LORA_TARGETS = tuple(f"stack/layers/block/self_attn/{p}/kernel" for p in
                     ("q_proj", "k_proj", "v_proj", "gate_proj", "out_proj"))
ZERO_BASE = 1e-6  # upstream keeps a target only if max|W| > this
UPSTREAM_KEYS = ("lora", "scale", "base", "rank")
LATE_KEYS = ("qat_bits", "qat_bits_map", "seed")  # 2.0.15's additions, after UPSTREAM_KEYS in its pickle
PEFT_LATE_KEY = "needle2_adapter"  # adapter_model.safetensors metadata: JSON of LATE_KEYS, when the adapter has them
PEFT_CONFIG, PEFT_WEIGHTS, PEFT_PICKLE_WEIGHTS = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's module names in its files
PICKLE_PROTOCOL = 4  # what upstream's `pickle.dump(adapter, f)` writes on Python 3.8-3.13 (the fixture's)
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _template(target: str) -> str:
    """The torch module of a target with the layer left open: "stack.layers.{i}.block.self_attn.q_proj"."""
    return _RULES[target].torch.removesuffix(".weight")


def module_name(target: str, layer: int) -> str:
    """The torch twin's module for layer `layer` of an upstream target: "stack.layers.3.block.self_attn.q_proj"."""
    return _template(target).format(i=layer)


def peft_key(target: str, layer: int, which: str) -> str:
    """PEFT's file key for A or B of one layer: base_model.model.<module>.lora_A.weight (adapter name dropped)."""
    return f"{PEFT_PREFIX}{module_name(target, layer)}.lora_{which}.weight"


def target_modules(targets: tuple[str, ...] = LORA_TARGETS) -> str:
    """PEFT's `target_modules` for these targets: one regex, which PEFT matches with re.fullmatch against each
    module name. A list would match by name suffix ("self_attn.q_proj") and so adapt mtp_block's too."""
    heads, names = set(), []
    for t in targets:
        head, name = _template(t).rsplit(".", 1)
        heads.add(head)
        names.append(name)
    (head,) = heads  # the five share their parent module
    return re.escape(head).replace(re.escape("{i}"), r"\d+") + r"\.(" + "|".join(names) + ")"


def _key_patterns() -> dict[str, re.Pattern]:
    out = {}
    for t in LORA_TARGETS:
        module = re.escape(_template(t)).replace(re.escape("{i}"), r"(\d+)")
        out[t] = re.compile(re.escape(PEFT_PREFIX) + module + r"\.lora_(A|B)\.weight")
    return out


_PEFT_KEYS = _key_patterns()


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter in upstream's terms; `lora` maps each target's flax path to {"A": (L, in, r), "B":
    (L, r, out)} (numpy, float32 from upstream; PEFT files keep their dtype), as `merge_lora` takes it."""

    lora: dict[str, dict[str, np.ndarray]]
    scale: float
    rank: int
    base: str = ""
    qat_bits: int | None = None  # 2.0.15: the CQ width the fine-tune's STE trained for (`needle build` exports it)
    qat_bits_map: str | None = None  # 2.0.15: the mixed bits map it trained for instead
    seed: int | None = None  # 2.0.15: the LoRA init's PRNGKey seed

    @property
    def late(self) -> dict[str, Any] | None:
        """2.0.15's extra fields as its pickle holds them; None for a 2.0.8 adapter (it has none of them)."""
        if self.qat_bits is None and self.qat_bits_map is None and self.seed is None:
            return None
        return {"qat_bits": self.qat_bits, "qat_bits_map": self.qat_bits_map, "seed": self.seed}

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.lora)

    @property
    def num_layers(self) -> int:
        return next(iter(self.lora.values()))["A"].shape[0]

    @property
    def alpha(self) -> float:
        """PEFT's lora_alpha: scale · rank, chosen so that alpha / rank gives back exactly this scale."""
        return peft_alpha(self.scale, self.rank)


def peft_alpha(scale: float, rank: int) -> float:
    """An alpha with alpha / rank == scale exactly, as PEFT divides (fl(scale · rank) misses for ~8 % of random
    scales); a round number when one works. Upstream's scales are alpha / rank, so such an alpha always exists for them;
    for any other scale the nearest one is returned (a 1-ulp change)."""
    guess = scale * rank
    for alpha in (float(round(guess)), guess):
        if alpha / rank == scale:
            return alpha
    up = down = guess
    for _ in range(8):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        for alpha in (up, down):
            if alpha / rank == scale:
                return alpha
    return guess


# ----------------------------------------------------------------------------- checks


def check_alone(adapter: Adapter, what: str, allow_untrained: bool = False) -> Adapter:
    """The adapter on its own: known targets, consistent shapes and rank, finite values, B not all zero."""
    if not adapter.lora:
        raise CheckpointError(f"{what}: the adapter has no targets; expected some of {', '.join(LORA_TARGETS)}")
    if isinstance(adapter.rank, bool) or not isinstance(adapter.rank, numbers.Integral) or adapter.rank < 1:
        raise CheckpointError(f"{what}: rank is {adapter.rank!r}; expected a positive integer")
    if isinstance(adapter.scale, bool) or not isinstance(adapter.scale, numbers.Real) \
            or not math.isfinite(adapter.scale):
        raise CheckpointError(f"{what}: scale is {adapter.scale!r}; expected a finite number (lora_alpha / rank)")
    if not isinstance(adapter.base, str):
        raise CheckpointError(f"{what}: base is of type {type(adapter.base).__name__}; expected the base "
                              "checkpoint's path as a string")
    _check_late(adapter, what)
    layers, zero = None, []
    for target, ab in adapter.lora.items():
        if target not in LORA_TARGETS:
            raise CheckpointError(
                f"{what}: adapter target {target!r} is not one of upstream's LoRA targets (lora_target_paths: the "
                f"main stack's attention kernels {', '.join(LORA_TARGETS)}); remove it, upstream cannot merge it")
        if not isinstance(ab, Mapping) or sorted(ab) != ["A", "B"]:
            got = sorted(ab) if isinstance(ab, Mapping) else type(ab).__name__
            raise CheckpointError(f"{what}: {target} must hold exactly the arrays 'A' and 'B', got {got}")
        a, b = ab["A"], ab["B"]
        for name, x in (("A", a), ("B", b)):
            if not isinstance(x, np.ndarray) or dtype_name(x.dtype) not in _FLOAT_DTYPES or x.ndim != 3:
                desc = f"{dtype_name(x.dtype)}{list(x.shape)}" if isinstance(x, np.ndarray) else type(x).__name__
                raise CheckpointError(f"{what}: {target} {name} is {desc}; expected a 3-D float array "
                                      f"({'(L, in, r)' if name == 'A' else '(L, r, out)'})")
        if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
            raise CheckpointError(f"{what}: {target} A {list(a.shape)} and B {list(b.shape)} do not chain; expected "
                                  "A (L, in, r) and B (L, r, out) with the same L and r")
        if a.shape[2] != adapter.rank:
            raise CheckpointError(f"{what}: {target} has rank {a.shape[2]} (A {list(a.shape)}, B {list(b.shape)}) but "
                                  f"the adapter's rank is {adapter.rank}; the file is inconsistent, re-export it")
        if layers is not None and a.shape[0] != layers:
            raise CheckpointError(f"{what}: {target} has {a.shape[0]} layers, other targets {layers}; every target "
                                  "must cover every layer")
        layers = a.shape[0]
        for name, x in (("A", a), ("B", b)):
            if not is_finite(x):
                raise CheckpointError(f"{what}: {target} {name} holds NaN or Inf values; the adapter is corrupt "
                                      "(a diverged run?), use another checkpoint of it")
        if not np.any(b):
            zero.append(target)
    if zero and not allow_untrained:
        raise CheckpointError(
            f"{what}: the adapter is untrained: B is all zero in {', '.join(zero)} (upstream initialises B = 0, so "
            "this adapter changes nothing: it was saved before any training step, upstream issue #59); re-run "
            "finetune, or pass allow_untrained=True to use it anyway")
    return adapter


def _is_int(x: Any) -> bool:
    return isinstance(x, (numbers.Integral, np.integer)) and not isinstance(x, (bool, np.bool_))


def _check_late(adapter: Adapter, what: str) -> None:
    """2.0.15's fields: qat_bits a CQ width or None, qat_bits_map a bits map or None, seed an integer or None."""
    if adapter.qat_bits is not None:
        if not _is_int(adapter.qat_bits) or adapter.qat_bits not in (2, 3, 4):
            raise CheckpointError(f"{what}: qat_bits is {adapter.qat_bits!r}; expected None or a CQ width 2, 3 or 4 "
                                  "(`needle finetune --qat-bits`)")
    if adapter.qat_bits_map is not None:
        if not isinstance(adapter.qat_bits_map, str):
            raise CheckpointError(f"{what}: qat_bits_map is of type {type(adapter.qat_bits_map).__name__}; expected "
                                  "None or a bits map string such as 'default=2,embedding=4'")
        try:
            parse_bits_map(adapter.qat_bits_map)
        except ConfigError as e:
            raise CheckpointError(f"{what}: qat_bits_map {adapter.qat_bits_map[:80]!r} is not a bits map ({e})") \
                from None
    if adapter.seed is not None and not _is_int(adapter.seed):
        raise CheckpointError(f"{what}: seed is {adapter.seed!r}; expected None or an integer (the LoRA init's "
                              "PRNGKey seed)")


def _late_fields(obj: Mapping[str, Any]) -> dict[str, Any]:
    """2.0.15's fields from a pickle dict or JSON (absent: None, as upstream's `adapter.get` reads them)."""
    out = {k: obj.get(k) for k in LATE_KEYS}
    for k in ("qat_bits", "seed"):
        if isinstance(out[k], np.integer):
            out[k] = int(out[k])
    return out


def _expected(target: str, config: TransformerConfig) -> tuple[int, int, int]:
    """(L, in, out) of a target's kernel in a model of this config."""
    d = dims(config)
    rule = _RULES[target]
    return (config.num_layers, *(d[s] for s in rule.shape))


def delta_shape(ab: Mapping[str, np.ndarray]) -> tuple[int, int, int]:
    return (ab["A"].shape[0], ab["A"].shape[1], ab["B"].shape[2])


def _check_config(adapter: Adapter, config: TransformerConfig, what: str) -> None:
    """The adapter fits a model of this config (layer count, widths)."""
    if adapter.num_layers != config.num_layers:
        raise CheckpointError(
            f"{what}: the adapter is for another base: it has {adapter.num_layers} layers, the base has "
            f"{config.num_layers} (num_layers); use the base it was trained on (its 'base' is {adapter.base!r})")
    for target, ab in adapter.lora.items():
        want = _expected(target, config)
        if delta_shape(ab) != want:
            raise CheckpointError(
                f"{what}: adapter/base shape mismatch at {target}: the adapter's A @ B is {list(delta_shape(ab))}, "
                f"the base's kernel is {list(want)} (d_model {config.d_model}, attn_dim {config.attn_dim}, "
                f"kv width {config.kv_dim}); the adapter is for another base (its 'base' is {adapter.base!r})")


def check_adapter(adapter: Adapter, params: Mapping[str, Any], config: TransformerConfig,
                  what: str = "LoRA adapter") -> None:
    """Everything that makes `needle build --lora` go wrong with this base: another base's shapes, targets on
    all-zero kernels (upstream never targets those), and a float16 merge that overflows (upstream issue #53)."""
    check_alone(adapter, what, allow_untrained=True)
    _check_config(adapter, config, what)
    flat = flatten_tree(params)
    for target in adapter.lora:
        w = flat.get(target)
        if w is not None and float(np.max(np.abs(np.asarray(w, np.float32)))) <= ZERO_BASE:
            raise CheckpointError(
                f"{what}: {target} targets an all-zero base kernel (max|W| <= {ZERO_BASE:g}); upstream's "
                "lora_target_paths keeps only kernels with max|W| > 1e-6, so this adapter was not trained on this "
                f"base (its 'base' is {adapter.base!r}); pass the right base")
    merged_params(adapter, params, what)


# ----------------------------------------------------------------------------- merge


def merge_lora(params: Mapping[str, Any], lora: Mapping[str, Mapping[str, np.ndarray]], scale: float
               ) -> dict[str, Any]:
    """A new param tree with every adapter target merged by upstream's rule; other leaves are shared, not copied."""
    flat = flatten_tree(params)
    for path, ab in lora.items():
        w = np.asarray(flat[path])
        a, b = np.asarray(ab["A"], np.float32), np.asarray(ab["B"], np.float32)
        delta = np.float32(scale) * np.matmul(a, b)  # (L, in, out), float32 like jnp's f32 @ f32
        flat[path] = w + delta.astype(w.dtype)
    return unflatten_tree(flat)


def merged_params(adapter: Adapter, params: Mapping[str, Any], what: str = "LoRA adapter") -> dict[str, Any]:
    """The base tree with the adapter merged (upstream's rule and dtypes: `needle build --lora`, the --merge
    output); refuses a target the base lacks or shapes differently, and a merge that overflows W's dtype."""
    flat = flatten_tree(params)
    for target, ab in adapter.lora.items():
        if target not in flat:
            raise CheckpointError(f"{what}: the base has no {target}; the adapter is for another model")
        shape = tuple(np.shape(flat[target]))
        if shape != delta_shape(ab):
            raise CheckpointError(f"{what}: adapter/base shape mismatch at {target}: the adapter's A @ B is "
                                  f"{list(delta_shape(ab))}, the base's kernel is {list(shape)}; the adapter is for "
                                  f"another base (its 'base' is {adapter.base!r})")
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below, with its numbers
        merged = merge_lora(params, adapter.lora, adapter.scale)
    out = flatten_tree(merged)
    for target, ab in adapter.lora.items():
        w = np.asarray(flat[target])
        if not is_finite(out[target]):
            delta = np.float32(adapter.scale) * np.matmul(np.asarray(ab["A"], np.float32),
                                                          np.asarray(ab["B"], np.float32))  # (L, in, out)
            total = w.astype(np.float32) + delta
            raise CheckpointError(
                f"{what}: merging into the {dtype_name(w.dtype)} base overflows at {target}: max|scale·A@B| = "
                f"{float(np.max(np.abs(delta))):.6g}, max|W + scale·A@B| = {float(np.max(np.abs(total))):.6g} in "
                f"float32, over {dtype_name(w.dtype)}'s {float(np.finfo(w.dtype).max):.6g} (upstream issue #53); "
                "merge into a float32 copy of the base, or lower the adapter's scale")
    return merged


# ----------------------------------------------------------------------------- upstream's adapter pickle


def read_upstream_adapter(path: str | Path, *, allow_untrained: bool = False) -> Adapter:
    """Read a `needle finetune` adapter pickle through the allowlist unpickler and check it (see `_check`)."""
    what = str(path)
    if not Path(path).is_file():
        raise CheckpointError(f"{what}: no such adapter file (upstream's adapter is one .pkl; a PEFT adapter is a "
                              "directory: read it with read_peft)")
    obj = load_file(path, what)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what}: not a LoRA adapter (the pickle holds a {type(obj).__name__}); expected "
                              "upstream's dict {lora, scale, base, rank} from `needle finetune`")
    if "params" in obj and "lora" not in obj:
        raise CheckpointError(f"{what}: this is a model checkpoint, not a LoRA adapter; pass the adapter file "
                              "`needle finetune` wrote")
    missing = [k for k in UPSTREAM_KEYS if k not in obj]
    if missing:
        raise CheckpointError(f"{what}: not a LoRA adapter: missing key(s) {missing} (it has {sorted(map(str, obj))});"
                              " expected upstream's dict {lora, scale, base, rank} from `needle finetune`")
    if not isinstance(obj["lora"], dict):
        raise CheckpointError(f"{what}: 'lora' is a {type(obj['lora']).__name__}; expected a dict {{target path: "
                              "{A, B}}")
    scale, rank = obj["scale"], obj["rank"]
    if isinstance(scale, (numbers.Real, np.floating)) and not isinstance(scale, bool):
        scale = float(scale)
    if isinstance(rank, (numbers.Integral, np.integer)) and not isinstance(rank, bool):
        rank = int(rank)
    return check_alone(Adapter(dict(obj["lora"]), scale, rank, obj["base"], **_late_fields(obj)), what,
                       allow_untrained)


def upstream_dict(adapter: Adapter, base: str | None = None) -> dict[str, Any]:
    """The adapter as upstream's `needle finetune` pickles it: float32 arrays, Python float scale and int rank;
    2.0.15's qat_bits, qat_bits_map and seed follow when the adapter has any of them (2.0.15 writes all three)."""
    lora = {t: {"A": np.ascontiguousarray(ab["A"], np.float32), "B": np.ascontiguousarray(ab["B"], np.float32)}
            for t, ab in sorted(adapter.lora.items())}  # sorted, as jax flattens the tree
    out = {"lora": lora, "scale": float(adapter.scale), "base": adapter.base if base is None else base,
           "rank": int(adapter.rank)}
    late = adapter.late
    if late is not None:
        out.update((k, int(v) if _is_int(v) else v) for k, v in late.items())
    return out


def write_upstream_adapter(adapter: Adapter, dst: str | Path, *, base: str | None = None,
                           force: bool = False) -> Path:
    """Write the adapter pickle upstream's `needle build --lora` reads (atomic; never over dst without force).

    base: the base checkpoint path to record (default: the adapter's own). Arrays are widened to float32
    exactly, as upstream's finetune keeps them."""
    dst = Path(dst)
    check_alone(adapter, str(dst), allow_untrained=True)
    data = pickle.dumps(upstream_dict(adapter, base), protocol=PICKLE_PROTOCOL)  # our own plain data
    with atomic_output(dst, force=force) as tmp:
        tmp.write_bytes(data)
    return dst


# ----------------------------------------------------------------------------- PEFT adapter directories


def peft_config(adapter: Adapter, base_name: str | None = None) -> dict[str, Any]:
    """adapter_config.json for PEFT 0.21's LoraConfig: plain LoRA on exactly the adapter's targets in every
    layer of the main stack. Fields left out take LoraConfig's defaults; none of those changes the forward."""
    alpha = adapter.alpha
    return {
        "peft_type": "LORA",
        "task_type": None,  # a bare PeftModel around the twin (no transformers head class)
        "base_model_name_or_path": adapter.base if base_name is None else base_name,
        "r": int(adapter.rank),
        "lora_alpha": int(alpha) if alpha.is_integer() else alpha,
        "target_modules": target_modules(tuple(sorted(adapter.lora, key=LORA_TARGETS.index))),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,  # the twin's Linear weights are (out, in), PEFT's default layout
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def peft_tensors(adapter: Adapter) -> dict[str, np.ndarray]:
    """PEFT's state: lora_A.weight (r, in) = A[i]ᵀ and lora_B.weight (out, r) = B[i]ᵀ for every layer i."""
    out = {}
    for target in sorted(adapter.lora, key=LORA_TARGETS.index):
        a, b = adapter.lora[target]["A"], adapter.lora[target]["B"]
        for i in range(a.shape[0]):
            out[peft_key(target, i, "A")] = np.ascontiguousarray(a[i].T)  # (in, r) -> (r, in)
            out[peft_key(target, i, "B")] = np.ascontiguousarray(b[i].T)  # (r, out) -> (out, r)
    return out


def write_peft(adapter: Adapter, config: TransformerConfig, dst: str | Path, *, base_name: str | None = None,
               force: bool = False) -> Path:
    """Write a PEFT adapter directory (adapter_model.safetensors + adapter_config.json) that
    `peft.PeftModel.from_pretrained(needle_torch.v2 model, dst)` loads onto exactly the main stack's
    attention projections. Atomic; never over an existing dst without force.

    base_name: base_model_name_or_path to record (default: the adapter's 'base')."""
    dst = Path(dst)
    what = str(dst)
    check_alone(adapter, what, allow_untrained=True)
    _check_config(adapter, config, what)
    tensors = [Planned.of(name, array) for name, array in peft_tensors(adapter).items()]
    text = json.dumps(peft_config(adapter, base_name), indent=2, sort_keys=True) + "\n"  # PEFT's own layout
    metadata = {"format": "pt"}  # PEFT's metadata; PEFT ignores any other key, so 2.0.15's fields ride along
    if adapter.late is not None:
        metadata[PEFT_LATE_KEY] = json.dumps({k: int(v) if _is_int(v) else v for k, v in adapter.late.items()})
    with atomic_output(dst, force=force, directory=True) as tmp:
        tmp.mkdir()
        safetensors_format.write_file(tmp / PEFT_WEIGHTS, tensors, metadata)
        (tmp / PEFT_CONFIG).write_text(text, encoding="utf-8")
    return dst


def read_peft(path: str | Path, *, allow_untrained: bool = False, num_layers: int | None = None) -> Adapter:
    """Read a PEFT LoRA adapter directory of the needle_torch.v2 twin as an upstream adapter.

    Refuses what upstream's merge cannot express (one line each): targets outside the five, a rank that
    differs between modules, DoRA and other variants, bias, rsLoRA, layers missing. num_layers: the base's
    layer count, when known, so that missing last layers are caught here too."""
    path = Path(path)
    what = str(path)
    if not path.is_dir():
        raise CheckpointError(f"{what}: not a PEFT adapter directory (expected {PEFT_CONFIG} and {PEFT_WEIGHTS})")
    if not (path / PEFT_CONFIG).is_file():
        raise CheckpointError(f"{what}: no {PEFT_CONFIG}; not a PEFT adapter directory")
    if not (path / PEFT_WEIGHTS).is_file():
        hint = (f"it holds {PEFT_PICKLE_WEIGHTS} (a torch pickle, not read for safety): re-save it with "
                "save_pretrained(..., safe_serialization=True)") if (path / PEFT_PICKLE_WEIGHTS).exists() \
            else "re-save the adapter with PeftModel.save_pretrained"
        raise CheckpointError(f"{what}: no {PEFT_WEIGHTS}; {hint}")
    try:
        config = json.loads((path / PEFT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what}/{PEFT_CONFIG}: not readable JSON ({type(e).__name__}); fix the file") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{what}/{PEFT_CONFIG}: a JSON {type(config).__name__}, not an object")
    refs, metadata, _ = safetensors_format.read_header(path / PEFT_WEIGHTS)
    tensors = {name: ref.load() for name, ref in refs.items()}
    adapter = from_peft_state(tensors, config, what, allow_untrained=allow_untrained, num_layers=num_layers)
    if PEFT_LATE_KEY not in metadata:
        return adapter  # PEFT's own files, or a 2.0.8 adapter's
    try:
        late = json.loads(metadata[PEFT_LATE_KEY])
    except json.JSONDecodeError:
        late = None
    if not isinstance(late, dict):
        raise CheckpointError(f"{what}/{PEFT_WEIGHTS}: its {PEFT_LATE_KEY!r} metadata is not a JSON object; the "
                              "file is damaged, re-convert the adapter")
    return check_alone(dataclasses.replace(adapter, **_late_fields(late)), what, allow_untrained)


# Fields whose non-default value changes what the adapter computes in ways upstream's W + scale·A@B cannot
# hold: extra trained modules or tokens, other LoRA variants (PEFT's lora_variants), other parametrisations.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) rescales each weight by a learned magnitude",
    "use_rslora": "rsLoRA (use_rslora) scales by lora_alpha / sqrt(r), not lora_alpha / r",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
    "modules_to_save": "modules_to_save holds fully trained copies of other modules",
    "trainable_token_indices": "trainable_token_indices trains embedding rows",
    "target_parameters": "target_parameters adapts raw parameters, not Linear modules",
    "layer_replication": "layer_replication duplicates layers",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies only after its tokens",
    "use_qalora": "QA-LoRA (use_qalora) pools its input",
    "arrow_config": "Arrow routing (arrow_config) mixes several adapters",
    "use_bdlora": "BD-LoRA (use_bdlora) is a block-diagonal variant",
    "velora_config": "VeLoRA (velora_config) is another variant",
    "monteclora_config": "MonteCLoRA (monteclora_config) is a sampled variant",
    "kasa_config": "KaSA (kasa_config) is an SVD-based variant",
}
# Initialisations that rewrite the base weights themselves: such an adapter only works on its modified base.
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first key that matches
    the end of the module name at a dot boundary."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def _peft_problem(config: Mapping[str, Any]) -> str | None:
    if config.get("peft_type") != "LORA":
        return f"peft_type is {config.get('peft_type')!r}; only LoRA adapters (peft_type LORA) convert"
    if config.get("bias", "none") != "none":
        return f"bias is {config['bias']!r}: PEFT trained the base biases too, upstream's adapter has no bias"
    for key, why in _UNSUPPORTED.items():
        if config.get(key):
            return f"{why}, which upstream's W + scale·A@B cannot express"
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.startswith(_BASE_REWRITING_INITS):
        return (f"init_lora_weights={init!r} rewrites the base weights, so the adapter needs that rewritten base; "
                "convert it in PEFT first (save_pretrained(path_initial_model_for_weight_conversion=...))")
    if init == "mica":
        return "init_lora_weights='mica' is a LoRA variant (MiCA) with its own forward"
    return None


def from_peft_state(tensors: Mapping[str, np.ndarray], config: Mapping[str, Any], what: str = "PEFT adapter", *,
                    allow_untrained: bool = False, num_layers: int | None = None) -> Adapter:
    """An Adapter from PEFT's saved state (keys as in adapter_model.safetensors) and its adapter_config dict."""
    problem = _peft_problem(config)
    if problem is not None:
        raise CheckpointError(f"{what}: cannot convert to upstream's adapter: {problem}")
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    for name, array in tensors.items():
        for target, pattern in _PEFT_KEYS.items():
            m = pattern.fullmatch(name)
            if m:
                found.setdefault(target, {}).setdefault(int(m[1]), {})[m[2]] = np.asarray(array)
                break
        else:
            raise CheckpointError(
                f"{what}: tensor {name!r} is outside upstream's LoRA targets (the main stack's attention "
                f"q/k/v/gate/out_proj: {PEFT_PREFIX}{module_name(LORA_TARGETS[0], 0)}.lora_A.weight, ...); "
                "retrain with needle_torch.v2.peft.lora_config's target_modules, or drop that module")
    if not found:
        raise CheckpointError(f"{what}: the adapter holds no LoRA tensors")
    layers = max(max(per) for per in found.values()) + 1 if num_layers is None else num_layers
    r_default, alpha_default = config.get("r", 8), config.get("lora_alpha", 8)
    ranks, scales, pairs = {}, {}, {}
    for target in sorted(found, key=LORA_TARGETS.index):
        per = found[target]
        missing = [i for i in range(layers) if i not in per]
        extra = [i for i in per if i >= layers]
        if missing or extra:
            raise CheckpointError(
                f"{what}: {target} is adapted in layers {sorted(per)} but the base has layers 0..{layers - 1} "
                f"(missing {missing or 'none'}{f', beyond: {extra}' if extra else ''}); upstream's adapter covers "
                "every layer: retrain without layers_to_transform")
        a_list, b_list = [], []
        for i in range(layers):
            pair = per[i]
            module = module_name(target, i)
            if sorted(pair) != ["A", "B"]:
                raise CheckpointError(f"{what}: {module} has lora_{''.join(sorted(pair))} but not both lora_A and "
                                      "lora_B; the file is incomplete")
            la, lb = pair["A"], pair["B"]  # (r, in), (out, r)
            if la.ndim != 2 or lb.ndim != 2 or la.shape[0] != lb.shape[1]:
                raise CheckpointError(f"{what}: {module} lora_A {list(la.shape)} and lora_B {list(lb.shape)} do "
                                      "not chain; expected (r, in) and (out, r)")
            r = la.shape[0]
            ranks[module] = r
            want_r = _pattern_value(config.get("rank_pattern") or {}, module, r_default)
            if want_r != r:
                raise CheckpointError(f"{what}: {module} has rank {r} in its tensors but adapter_config gives it r = "
                                      f"{want_r}; the adapter is inconsistent, re-save it")
            alpha = _pattern_value(config.get("alpha_pattern") or {}, module, alpha_default)
            scales[module] = alpha / r
            a_list.append(la.T)  # (r, in) -> (in, r)
            b_list.append(lb.T)  # (out, r) -> (r, out)
        pairs[target] = (a_list, b_list)
    if len(set(ranks.values())) > 1:
        raise CheckpointError(f"{what}: the rank differs between modules ({_spread(ranks)}); upstream's adapter has "
                              "one rank, retrain without rank_pattern")
    if len(set(scales.values())) > 1:
        raise CheckpointError(f"{what}: the scale lora_alpha / r differs between modules ({_spread(scales)}); "
                              "upstream's adapter has one scale, retrain without alpha_pattern")
    lora = {}
    for target, (a_list, b_list) in pairs.items():
        if len({a.shape for a in a_list}) > 1 or len({b.shape for b in b_list}) > 1:
            raise CheckpointError(f"{what}: {target}'s widths differ between layers; the adapter is not for one model")
        lora[target] = {"A": np.stack(a_list), "B": np.stack(b_list)}  # (L, in, r), (L, r, out)
    base = config.get("base_model_name_or_path") or ""
    return check_alone(Adapter(lora, next(iter(scales.values())), next(iter(ranks.values())), str(base)), what,
                       allow_untrained)


def _spread(values: Mapping[str, Any]) -> str:
    """'r=4 at a.q_proj, r=8 at b.k_proj': one module per distinct value."""
    first: dict[Any, str] = {}
    for module, v in values.items():
        first.setdefault(v, module)
    return ", ".join(f"{v:g} at {m}" for v, m in first.items())


# ----------------------------------------------------------------------------- for the CLI


def read_adapter(path: str | Path, *, allow_untrained: bool = False) -> Adapter:
    """An adapter from upstream's pickle (a file) or a PEFT adapter directory."""
    reader = read_peft if Path(path).is_dir() else read_upstream_adapter
    return reader(path, allow_untrained=allow_untrained)


def write_adapter(adapter: Adapter, config: TransformerConfig, dst: str | Path, *, base: str | None = None,
                  force: bool = False) -> Path:
    """dst ending in .pkl: upstream's adapter pickle; anything else: a PEFT adapter directory."""
    if Path(dst).suffix == ".pkl":
        _check_config(adapter, config, str(dst))
        return write_upstream_adapter(adapter, dst, base=base, force=force)
    return write_peft(adapter, config, dst, base_name=base, force=force)


def describe(adapter: Adapter) -> dict[str, Any]:
    """What `inspect` shows: targets with their A/B shapes and dtypes, rank, scale, PEFT's alpha, layers, base."""
    return {
        "format": "Needle 2 LoRA adapter",
        "base": adapter.base,
        "layers": adapter.num_layers,
        "rank": adapter.rank,
        "scale": adapter.scale,
        "lora_alpha": adapter.alpha,
        "targets": {t: {"A": list(ab["A"].shape), "B": list(ab["B"].shape), "dtype": dtype_name(ab["A"].dtype)}
                    for t, ab in adapter.lora.items()},
        "untrained_targets": [t for t, ab in adapter.lora.items() if not np.any(ab["B"])],
        "qat_bits": adapter.qat_bits,
        "qat_bits_map": adapter.qat_bits_map,
        "seed": adapter.seed,
    }


__all__ = [
    "LORA_TARGETS", "Adapter", "check_adapter", "describe", "from_peft_state", "merge_lora", "merged_params",
    "module_name", "peft_alpha", "peft_config", "peft_key", "peft_tensors", "read_adapter", "read_peft",
    "read_upstream_adapter", "target_modules", "upstream_dict", "write_adapter", "write_peft",
    "write_upstream_adapter",
]
