"""The Flax <-> torch parameter mapping: one declarative table of layout-only rules.

Each rule names a Flax path, a torch name, the per-layer Flax shape and whether the
array is transposed (Dense kernels are (in, out); torch Linear weights are (out, in)).
Rules under a scanned stack carry `{i}` in the torch name and a leading layer axis on
the Flax side. Rules only rename, transpose and (un)stack, never do arithmetic, so
Flax -> torch -> Flax is bit-exact by construction in every dtype.

Everything here works on numpy arrays; `flax_to_torch` / `torch_to_flax` convert at the
edges and import torch lazily, so `convert` itself imports neither torch nor jax.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from convert.config import TransformerConfig
from convert.errors import CheckpointError

ENCODER = "encoder/layers/EncoderBlock_0"
DECODER = "decoder/layers/DecoderBlock_0"


@dataclass(frozen=True)
class Rule:
    flax: str  # path in the Flax param tree, "/"-joined
    torch: str  # state_dict key; "{i}" = layer index when stacked
    shape: tuple[str, ...]  # per-layer Flax shape in symbols (see `dims`)
    transpose: bool = False  # Dense kernel (in, out) <-> Linear weight (out, in)
    stack: str | None = None  # "encoder" / "decoder": scanned, leading layer axis in Flax


def dims(config: TransformerConfig) -> dict[str, int]:
    return {
        "V": config.vocab_size, "D": config.d_model, "h": config.head_dim,
        "KH": config.num_kv_heads * config.head_dim, "F": config.d_ff,
        "D4": config.d_model // 4, "C": config.contrastive_dim,
    }


def _attention(flax: str, torch: str, stack: str) -> list[Rule]:
    proj = {"q_proj": ("D", "D"), "k_proj": ("D", "KH"), "v_proj": ("D", "KH"), "out_proj": ("D", "D")}
    rules = [Rule(f"{flax}/{p}/kernel", f"{torch}.{p}.weight", s, True, stack) for p, s in proj.items()]
    rules += [Rule(f"{flax}/{n}/scale", f"{torch}.{n}.scale", ("h",), False, stack) for n in ("q_norm", "k_norm")]
    return rules


def _ffn(flax: str, torch: str, stack: str) -> list[Rule]:
    proj = {"gate_proj": ("D", "F"), "up_proj": ("D", "F"), "down_proj": ("F", "D")}
    return [Rule(f"{flax}/{p}/kernel", f"{torch}.{p}.weight", s, True, stack) for p, s in proj.items()]


def rules(config: TransformerConfig) -> list[Rule]:
    """The whole table for one config (FFN rules only when the model has an FFN)."""
    E, Dd = "encoder.layers.{i}", "decoder.layers.{i}"
    table = [Rule("embedding/embedding", "embedding.weight", ("V", "D"))]
    table += [
        Rule(f"{ENCODER}/ZCRMSNorm_0/scale", f"{E}.attn_norm.scale", ("D",), stack="encoder"),
        Rule(f"{ENCODER}/attn_gate", f"{E}.attn_gate", (), stack="encoder"),
        *_attention(f"{ENCODER}/self_attn", f"{E}.self_attn", "encoder"),
    ]
    if not config.no_feedforward:
        table += [
            Rule(f"{ENCODER}/ZCRMSNorm_1/scale", f"{E}.ffn_norm.scale", ("D",), stack="encoder"),
            Rule(f"{ENCODER}/ffn_gate", f"{E}.ffn_gate", (), stack="encoder"),
            *_ffn(f"{ENCODER}/FeedForward_0", f"{E}.ffn", "encoder"),
        ]
    table.append(Rule("encoder/final_norm/scale", "encoder.final_norm.scale", ("D",)))
    table += [
        Rule(f"{DECODER}/ZCRMSNorm_0/scale", f"{Dd}.self_attn_norm.scale", ("D",), stack="decoder"),
        Rule(f"{DECODER}/self_attn_gate", f"{Dd}.self_attn_gate", (), stack="decoder"),
        *_attention(f"{DECODER}/self_attn", f"{Dd}.self_attn", "decoder"),
        Rule(f"{DECODER}/ZCRMSNorm_1/scale", f"{Dd}.cross_attn_norm.scale", ("D",), stack="decoder"),
        Rule(f"{DECODER}/cross_attn_gate", f"{Dd}.cross_attn_gate", (), stack="decoder"),
        *_attention(f"{DECODER}/cross_attn", f"{Dd}.cross_attn", "decoder"),
    ]
    if not config.no_feedforward:
        table += [
            Rule(f"{DECODER}/ZCRMSNorm_2/scale", f"{Dd}.ffn_norm.scale", ("D",), stack="decoder"),
            Rule(f"{DECODER}/ffn_gate", f"{Dd}.ffn_gate", (), stack="decoder"),
            *_ffn(f"{DECODER}/FeedForward_0", f"{Dd}.ffn", "decoder"),
        ]
    table += [
        Rule("decoder/ZCRMSNorm_0/scale", "decoder.final_norm.scale", ("D",)),
        Rule("contrastive_hidden/kernel", "contrastive_hidden.weight", ("D", "D4"), True),
        Rule("contrastive_hidden/bias", "contrastive_hidden.bias", ("D4",)),
        Rule("contrastive_proj/kernel", "contrastive_proj.weight", ("D4", "C"), True),
        Rule("log_temp", "log_temp", ()),
    ]
    return table


def num_layers(config: TransformerConfig, stack: str | None) -> int | None:
    return {"encoder": config.num_encoder_layers, "decoder": config.num_decoder_layers}.get(stack)


def flax_shape(rule: Rule, config: TransformerConfig) -> tuple[int, ...]:
    d = dims(config)
    per_layer = tuple(d[s] for s in rule.shape)
    n = num_layers(config, rule.stack)
    return per_layer if n is None else (n, *per_layer)


def torch_shape(rule: Rule, config: TransformerConfig) -> tuple[int, ...]:
    d = dims(config)
    per_layer = tuple(d[s] for s in rule.shape)
    return per_layer[::-1] if rule.transpose else per_layer


def torch_names(rule: Rule, config: TransformerConfig) -> list[str]:
    n = num_layers(config, rule.stack)
    return [rule.torch] if n is None else [rule.torch.format(i=i) for i in range(n)]


def expected_flax_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    return {r.flax: flax_shape(r, config) for r in rules(config)}


def expected_torch_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    return {name: torch_shape(r, config) for r in rules(config) for name in torch_names(r, config)}


# ----------------------------------------------------------------------------- trees


def flatten_tree(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict (or FrozenDict) -> {"a/b/c": leaf}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_tree(value, path + "/"))
        else:
            flat[path] = value
    return flat


def unflatten_tree(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a/b/c": leaf} -> nested dict."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def check_entries(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], what: str,
                  hint: str = "") -> None:
    """One error listing every missing, unexpected and mis-shaped entry."""
    parts = entry_problems(found, expected)
    if parts:
        raise CheckpointError(f"{what} does not match the config: " + "; ".join(parts) + (f". {hint}" if hint else ""))


def entry_problems(found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> list[str]:
    """The missing, unexpected and mis-shaped entries, one phrase per kind (empty when all match)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(k for k in set(found) & set(expected) if tuple(found[k]) != tuple(expected[k]))
    parts = []
    if missing:
        parts.append(f"missing {len(missing)}: {', '.join(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {', '.join(unexpected)}")
    if misshaped:
        parts.append("wrong shape: " + ", ".join(
            f"{k} is {tuple(found[k])}, expected {tuple(expected[k])}" for k in misshaped))
    return parts


def _as_numpy(x: Any) -> np.ndarray:
    if type(x).__module__.startswith("torch"):
        return _torch_to_numpy(x)
    return np.asarray(x)


def iter_flax_to_torch(params: Mapping[str, Any], config: TransformerConfig) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (torch name, numpy array) one tensor at a time, after checking the whole tree."""
    flat = flatten_tree(params)
    check_entries({k: np.shape(v) for k, v in flat.items()}, expected_flax_shapes(config), "Flax params",
                  "Is the config the one this checkpoint was trained with?")
    for rule in rules(config):
        arr = _as_numpy(flat[rule.flax])
        layers = [arr] if rule.stack is None else [arr[i, ...] for i in range(arr.shape[0])]  # 0-d stays an array
        for name, a in zip(torch_names(rule, config), layers, strict=True):
            yield name, _contiguous(a.T if rule.transpose else a)


def flax_to_torch_numpy(params: Mapping[str, Any], config: TransformerConfig) -> dict[str, np.ndarray]:
    """Flax param tree -> {torch name: numpy array}, dtypes kept."""
    return dict(iter_flax_to_torch(params, config))


def torch_numpy_to_flax(state: Mapping[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """{torch name: array or tensor} -> nested upstream Flax tree of numpy arrays, dtypes kept."""
    check_entries({k: tuple(v.shape) for k, v in state.items()}, expected_torch_shapes(config), "torch state_dict",
                  "Is the config the one this checkpoint was trained with?")
    flat = {}
    for rule in rules(config):
        layers = [_as_numpy(state[name]) for name in torch_names(rule, config)]
        layers = [a.T if rule.transpose else a for a in layers]
        dtypes = {a.dtype for a in layers}
        if len(dtypes) > 1:
            raise CheckpointError(
                f"{rule.torch} has mixed dtypes across layers ({', '.join(sorted(map(str, dtypes)))}); "
                "cast the state_dict to one dtype first"
            )
        flat[rule.flax] = _contiguous(layers[0] if rule.stack is None else np.stack(layers))
    return unflatten_tree(flat)


def _contiguous(a: np.ndarray) -> np.ndarray:
    """C-contiguous copy only when needed; unlike np.ascontiguousarray, keeps 0-d arrays 0-d."""
    return a if a.flags.c_contiguous else a.copy(order="C")


# ----------------------------------------------------------------------------- torch edge


def _torch_to_numpy(t: Any) -> np.ndarray:
    import torch

    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def numpy_to_torch(a: np.ndarray):
    """numpy -> torch sharing memory where possible; bfloat16 through its bit pattern."""
    import torch

    a = _contiguous(a)
    if not a.flags.writeable:  # torch tensors are writable: never alias read-only (e.g. mmapped) memory
        a = a.copy()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def flax_to_torch(params: Mapping[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """Flax param tree -> torch state_dict that `load_state_dict(strict=True)` accepts; dtypes kept."""
    return {name: numpy_to_torch(a) for name, a in iter_flax_to_torch(params, config)}


def torch_to_flax(state_dict: Mapping[str, Any], config: TransformerConfig) -> dict[str, Any]:
    """torch state_dict -> upstream Flax param tree (nested dict of numpy arrays); dtypes kept."""
    return torch_numpy_to_flax(state_dict, config)


def random_flax_params(config: TransformerConfig, seed: int = 0, dtype: str = "float32",
                       std: float = 0.02) -> dict[str, Any]:
    """A Flax tree with EVERY leaf random (norm scales and gates too, so a wrong mapping cannot hide).

    Matrices ~ N(0, std); norm scales, gates, biases and log_temp ~ N(0, 0.1)."""
    rng = np.random.default_rng(seed)
    flat = {}
    for rule in rules(config):
        shape = flax_shape(rule, config)
        scale = std if len(rule.shape) == 2 else 0.1
        flat[rule.flax] = (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np_dtype(dtype))
    return unflatten_tree(flat)


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for "float32", "bfloat16", "float16", ... (bfloat16 and float8 kinds via ml_dtypes)."""
    if name.startswith(("bfloat16", "float8")):
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def markdown_table() -> str:
    """The mapping as a markdown table (docs/MAPPING.md is generated from this; a test keeps them equal)."""
    config = TransformerConfig(no_feedforward=False)
    lines = [
        "| torch name | Flax path | per-layer Flax shape | layout |",
        "|---|---|---|---|",
    ]
    for r in rules(config):
        parts = ["transposed"] if r.transpose else []
        parts += [f"stacked on axis 0 over {r.stack} layers"] if r.stack else []
        layout = "; ".join(parts) or "as is"
        shape = "(" + ", ".join(r.shape) + (",)" if len(r.shape) == 1 else ")")
        lines.append(f"| `{r.torch}` | `{r.flax}` | {shape} | {layout} |")
    return "\n".join(lines) + "\n"
