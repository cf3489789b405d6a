"""Golden files for Needle 3, computed by upstream's own code (cactus-needle 3.2.8).

This is the ONLY place in the repo that imports upstream's package `needle`; the product
never does. Run it through `tools/upstream_goldens.sh`, which builds the pinned virtualenv
`.upstream-venv/` and turns telemetry off. The script draws tokens, initialises and
perturbs params, and drives upstream's functions; it never re-implements upstream math.

For every config NAME in CONFIGS it writes into --out (default tests/data/v3/):
  NAME.safetensors          format-v2 checkpoint, float32 params (`C.write_checkpoint`)
  NAME.npz                  inputs and goldens under f32/ and bf16/, plus meta_json
  NAME.command              the command line, versions, and what the config covers
  NAME.lora.safetensors     LoRA adapter (configs with "lora")
  NAME.rung{d}.safetensors  the depth-d rung `F.rung` produces (configs with "rung")
and, from the shared fixture needle-v3-tiny (its checkpoint and its SentencePiece model):
  needle-v3-tiny.text.npz   texts through upstream's tokenizer, then the three heads on them
  needle-v3-tiny.text.command
  needle-v3-tiny.window.npz greedy decoding under a kv window with sinks (hidden_cells' mask through __call__)
  needle-v3-tiny.window.command

Names: A architecture, C checkpoints, R run, F finetune, Q quantize (upstream modules).
bf16 means config dtype "bfloat16" AND every param cast to bfloat16 first.
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import shlex
import sys

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_default_matmul_precision", "highest")

import needle.model.architecture as A  # noqa: E402
import needle.model.checkpoints as C  # noqa: E402
import needle.model.finetune as F  # noqa: E402
import needle.model.quantize as Q  # noqa: E402
import needle.model.run as R  # noqa: E402
import needle.model.tokenizer as TK  # noqa: E402

PAD, EOS, BOS = 0, 1, 2
FIRST_ID = 20              # ids 0-19 are special (PAD, EOS, BOS, UNK, 16 chat markers)
IMPORT_DEPLOY = dict(act_bits=Q.ACT_BITS, kv_bits=Q.KV_BITS, kv_group=Q._KV_GROUP)
LORA_RANK, LORA_SCALE, LORA_SEED = 4, 2.0, 3
NEW_TOKENS = 10

# fields: what goes into A.TransformerConfig (the saved config is dict(cfg.__dict__) of it).
CONFIGS = {
    "noengram": dict(
        fields=dict(vocab_size=96, d_model=64, num_heads=4, num_kv_heads=2, num_layers=4,
                    embedding_dim=32, embedding_queries=2,
                    qk_head_dim=16, v_head_dim=8, max_seq_len=64, engram_layers=(),
                    engram_slots=61, global_layers=(), sliding_window=0, qkv_conv_taps=2,
                    mhc_lanes=2, flash=True),
        seed=11, T=16, depth=2, prompt_len=7, width=32,
        covers=["no engram sites", "flash path with qk_head_dim 16 > v_head_dim 8 (v padded)",
                "GQA 4 query heads / 2 kv heads", "qkv conv with 2 taps",
                "no sliding window, no global layers", "mHC with 2 lanes",
                "width child: A.width_config(cfg, 32) + A.width_slice (width_logits)",
                "depth-2 exit/subnetwork/ladder (layers 0, 3)"]),
    "mqa": dict(
        fields=dict(vocab_size=300, out_vocab=200, embedding_dim=32, d_model=48, num_heads=4, num_kv_heads=1,
                    num_layers=4, qk_head_dim=8, v_head_dim=16, max_seq_len=64,
                    engram_layers=(0, 2), engram_seed_heads=3, engram_slots=97,
                    global_layers=(), sliding_window=6, qkv_conv_taps=0, mhc_lanes=3),
        seed=12, T=16, depth=3, prompt_len=9,
        covers=["MQA: 1 kv head", "d_model 48, not a power of two (Hadamard pads to 64)",
                "qk_head_dim 8 < v_head_dim 16 (flash pads q/k)",
                "out_vocab 200 < vocab 300 (logits over the first 200 rows; ids >= 200 "
                "in the inputs)", "engram sites (0, 2) with engram_seed_heads 3",
                "no qkv conv (taps 0)", "sliding window 6 on every layer, no global layers",
                "mHC with 3 lanes", "embedding_dim 32", "depth-3 rung drops engram site 1 (layer 2)",
                "greedy prompt longer than the window"]),
    "window": dict(
        fields=dict(vocab_size=96, embedding_dim=32, confidence_probes=2, d_model=96, num_heads=6, num_kv_heads=3,
                    num_layers=5,
                    qk_head_dim=12, v_head_dim=12, max_seq_len=64, engram_layers=(2,),
                    engram_slots=61, global_layers=(1, 4), sliding_window=5,
                    qkv_conv_taps=3, mhc_lanes=2, flash=False,
                    ladder_order=(0, 4, 1, 3, 2)),
        seed=13, T=16, depth=3, prompt_len=8, rung=True,
        covers=["non-flash attention path (flash=False)",
                "d_model 96, not a power of two (Hadamard pads to 128)",
                "equal head dims 12/12, 6 heads / 3 kv heads", "qkv conv with 3 taps",
                "sliding window 5 with global layers (1, 4)", "one engram site (layer 2)",
                "custom ladder_order (0, 4, 1, 3, 2): depth 3 keeps layers (0, 1, 4), "
                "drops the engram site, global layers remap to (1, 2)",
                "mHC with 2 lanes", "embedding_dim 32, 2 confidence probes",
                "rung checkpoint window.rung3.safetensors"]),
    "flashsplit": dict(
        fields=dict(vocab_size=128, d_model=64, num_heads=4, num_kv_heads=2, num_layers=5,
                    qk_head_dim=8, v_head_dim=24, max_seq_len=64, engram_layers=(1, 3),
                    engram_heads=2, engram_slots=61, global_layers=(2,), sliding_window=4,
                    qkv_conv_taps=3, mhc_lanes=4, flash=True),
        seed=14, T=16, depth=2, prompt_len=9, rung=True, lora=True,
        covers=["flash path with qk_head_dim 8 < v_head_dim 24",
                "explicit engram_heads 2 (4 tables of sub_dim 16), sites (1, 3)",
                "sliding window 4 with global layer 2", "qkv conv with 3 taps",
                "mHC with 4 lanes", "default heads (embedding_dim 128, 4 probes, 4 queries)",
                "LoRA adapter rank 4 scale 2.0 (lora_logits)",
                "depth-2 rung keeps layers (0, 4): drops both engram sites and the only "
                "global layer", "rung checkpoint flashsplit.rung2.safetensors"]),
}


# ---------------------------------------------------------------- inputs

def make_tokens(rng, vocab, T):
    """(3, T) int32: full row, left-padded row, right-padded row; BOS then ids >= 20."""
    ids = lambda n: rng.integers(FIRST_ID, vocab, size=n)  # noqa: E731
    left, right = 4, 5
    rows = [np.concatenate([[BOS], ids(T - 1)]),
            np.concatenate([np.zeros(left, int), [BOS], ids(T - left - 1)]),
            np.concatenate([[BOS], ids(T - right - 1), np.zeros(right, int)])]
    return np.stack(rows).astype(np.int32)


def make_prompt(rng, vocab, length):
    return np.concatenate([[BOS], rng.integers(FIRST_ID, vocab, size=length - 1)]
                          ).astype(np.int32)[None]


def with_dtype(cfg, dtype):
    return A.TransformerConfig(**{**cfg.__dict__, "dtype": dtype})


def to_bf16(tree):
    return jax.tree.map(lambda a: jnp.asarray(a).astype(jnp.bfloat16), tree)


def np_tree(tree):
    return jax.tree.map(np.asarray, tree)


# ---------------------------------------------------------------- params

def init_all(module, tokens):
    """Call every entry point so the three flax setup heads get params too."""
    module(tokens)
    module.forward_embedding(tokens)
    module.forward_confidence(tokens)
    module.forward_router(tokens)


def init_params(cfg32, tokens, seeds):
    """One jitted init per key (jit only for speed: eager init of the scan is slow)."""
    m = A.SimpleAttentionNetwork(cfg32)
    init = jax.jit(lambda key, t: m.init(key, t, method=init_all)["params"])
    return [init(jax.random.PRNGKey(s), jnp.asarray(tokens)) for s in seeds]


def perturb(params, other, seed):
    """Perturb leaves whose init does not depend on the key, so every param matters.

    A leaf is key-independent when an init with another key gives the same value.
    d4 and mhc_a_* (small positive constants) are scaled by 1 + 0.1 N(0, 1); all other
    such leaves get N(0, 0.1) added. Draws come from default_rng(seed), sorted path order.
    """
    other = C.flatten(np_tree(other))
    flat = C.flatten(np_tree(params))
    rng = np.random.default_rng(seed)
    done = {}
    for path in sorted(flat):
        value = flat[path]
        if not np.array_equal(value, other[path]):
            continue
        leaf = path.rsplit("/", 1)[1]
        noise = rng.standard_normal(value.shape).astype(np.float32)
        if leaf == "d4" or leaf.startswith("mhc_a_"):
            flat[path] = (value * (1 + 0.1 * noise)).astype(np.float32)
            done[path] = "scale 1+0.1N"
        else:
            flat[path] = (value + 0.1 * noise).astype(np.float32)
            done[path] = "add 0.1N"
    return C.unflatten(flat), done, C.flatten(np_tree(params))


# ---------------------------------------------------------------- files

def content_sha256(path):
    """sha256 over the header with sorted keys plus the data (raw header order varies)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.dumps(json.loads(raw[8:8 + n]), sort_keys=True).encode()
    return hashlib.sha256(header + raw[8 + n:]).hexdigest()


def write_base_checkpoint(path, params, saved, name, seed, argv):
    C.write_checkpoint(path, {
        "format_version": 2, "params": np_tree(params), "config": saved, "step": 1000,
        "run": {"name": name, "seed": seed, "argv": argv,
                "note": "random perturbed weights made by tools/upstream_goldens.py"}})


def write_rung(path, params, cfg, depth, name, argv):
    """What `needle build --layers d` does before export: F.rung on the loaded checkpoint."""
    rung_params, rung_cfg = F.rung(params, cfg, depth)
    C.write_checkpoint(path, {
        "format_version": 2, "params": np_tree(rung_params),
        "config": dict(rung_cfg.__dict__), "step": 1000,
        "run": {"name": f"{name}.rung{depth}", "argv": argv,
                "note": f"F.rung(params, cfg, {depth}) of {name}.safetensors"}})
    return rung_cfg


def make_lora(params, path, base_name):
    """Upstream's init_lora with B redrawn N(0, 0.02) so the adapter does something."""
    paths = F.lora_target_paths(params)
    lora = F.init_lora(params, paths, LORA_RANK, jax.random.PRNGKey(LORA_SEED))
    rng = np.random.default_rng(LORA_SEED)
    for p in sorted(lora):
        shape = lora[p]["B"].shape
        lora[p]["B"] = (0.02 * rng.standard_normal(shape)).astype(np.float32)
    C.write_adapter(path, {
        "lora": {"/".join(p): {"A": np.asarray(v["A"]), "B": np.asarray(v["B"])}
                 for p, v in lora.items()},
        "scale": LORA_SCALE, "base": base_name, "rank": LORA_RANK, "seed": LORA_SEED})
    # read it back exactly as build_main does
    adapter = C.read_adapter(path)
    back = {tuple(k.split("/")): {"A": jnp.asarray(v["A"]), "B": jnp.asarray(v["B"])}
            for k, v in adapter["lora"].items()}
    same = all(np.array_equal(np.asarray(lora[p][m]), np.asarray(back[p][m]))
               for p in lora for m in ("A", "B")) and set(lora) == set(back)
    return back, adapter["scale"], ["/".join(p) for p in sorted(paths)], same


# ---------------------------------------------------------------- goldens

def ladder_logits(cfg, params, tokens, depth):
    lcfg = A.ladder_config(cfg, depth)
    return A.SimpleAttentionNetwork(lcfg).apply(
        {"params": A.ladder_slice(params, cfg, depth)}, tokens)


def width_logits(cfg, params, tokens, w):
    wcfg = A.width_config(cfg, w)
    return A.SimpleAttentionNetwork(wcfg).apply(
        {"params": A.width_slice(params, cfg, w)}, tokens)


def lora_logits(cfg, params, tokens, lora):
    lora_tree, scale = lora
    return A.SimpleAttentionNetwork(cfg).apply(
        {"params": F.merge_lora(params, lora_tree, scale)}, tokens)


def main_outputs(cfg, spec, lora=None, refused=None):
    """One jitted function calling every model method (no quant).

    Optional arrays (ladder, width, LoRA) are traced inside a try: when upstream refuses
    one (an assert or a flax shape error, both raised while tracing), the reason goes to
    `refused` and the array is left out.
    """
    m = A.SimpleAttentionNetwork(cfg)
    depth = spec["depth"]
    optional = {"ladder_logits": lambda p, t: ladder_logits(cfg, p, t, depth)}
    if spec.get("width"):
        optional["width_logits"] = lambda p, t: width_logits(cfg, p, t, spec["width"])
    if lora is not None:
        optional["lora_logits"] = lambda p, t: lora_logits(cfg, p, t, lora)

    @jax.jit
    def run(params, tokens):
        v = {"params": params}
        full, exit_ = m.apply(v, tokens, exit_depth=depth)
        out = {
            "logits": m.apply(v, tokens),
            "hidden_states": m.apply(v, tokens, method="hidden_states"),
            "hidden_cells": m.apply(v, tokens, method="hidden_cells"),
            "embedding": m.apply(v, tokens, method="forward_embedding"),
            "confidence": m.apply(v, tokens, method="forward_confidence"),
            "router": m.apply(v, tokens, method="forward_router"),
            "full_logits": full,
            "exit_logits": exit_,
            "subnetwork_logits": m.apply(v, tokens, exit_depth=depth, subnetwork_only=True),
        }
        for key, fn in optional.items():
            try:
                out[key] = fn(params, tokens)
            except Exception as err:  # upstream refused: record why, skip the array
                if refused is not None:
                    refused[key] = f"{type(err).__name__}: {err}"
        return out
    return run


def quant_logits(cfg, params, tokens):
    """quant=True under the deploy numerics finetune_local sets (A8, KV8), then restore."""
    Q.configure_deploy(act_bits=8, kv_bits=8)
    try:
        m = A.SimpleAttentionNetwork(cfg)
        return jax.jit(lambda p, t: m.apply({"params": p}, t, quant=True))(params, tokens)
    finally:
        Q.configure_deploy(**IMPORT_DEPLOY)


class IdentityTokenizer:
    """Stand-in tokenizer: encode/decode are the identity on id lists."""
    def encode(self, ids):
        return list(ids)

    def decode(self, ids):
        return list(ids)


def greedy(cfg, params, prompt):
    """R.generate's tokens, plus the per-step logits replayed with its own decode fn."""
    m = A.SimpleAttentionNetwork(cfg)
    tokens = R.generate(m, params, IdentityTokenizer(), list(prompt[0, 1:]),
                        max_new_tokens=NEW_TOKENS, temperature=0.0, stream=False)
    P = prompt.shape[1]
    buf_len = min(cfg.max_seq_len, P + NEW_TOKENS)
    decode_fn = R._get_decode_fn(m, buf_len)
    buf = jnp.full((1, buf_len), PAD, jnp.int32).at[0, :P].set(jnp.asarray(prompt[0]))
    replay, steps = [], []
    for pos in range(P - 1, buf_len - 1):
        logits = decode_fn(params, buf)[0, pos]
        nxt = int(jnp.argmax(logits))
        if nxt == EOS:
            break
        replay.append(nxt)
        steps.append(np.asarray(logits, np.float32))
        buf = buf.at[0, pos + 1].set(nxt)
    return (np.asarray([tokens], np.int32), np.asarray([replay], np.int32),
            np.stack(steps)[None])


def goldens(cfg, params, tokens, prompt, spec, lora, meta, tag):
    """Every golden for one dtype; refusals go to meta["refused"]. Returns (out, run)."""
    t = jnp.asarray(tokens)
    refused = {}
    run = main_outputs(cfg, spec, lora, refused)
    out = {k: np.asarray(v, np.float32) for k, v in run(params, t).items()}
    meta["refused"].update({f"{tag}/{k}": v for k, v in refused.items()})
    gen, replay, steps = greedy(cfg, params, prompt)
    meta["checks"][f"{tag}/generate_equals_replay"] = bool(np.array_equal(gen, replay))
    out["greedy_tokens"], out["greedy_logits"] = gen, steps
    # quant last: configure_deploy is process-global
    out["quant_logits"] = np.asarray(quant_logits(cfg, params, t), np.float32)
    return out, run


# ---------------------------------------------------------------- checks

def max_diff(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def sensitivity(run, params, init_flat, perturbed, tokens):
    """Max change of any f32 golden when one perturbed leaf is set back to its init."""
    base = run(params, jnp.asarray(tokens))
    flat = C.flatten(np_tree(params))
    result = {}
    for path in sorted(perturbed):
        trial = dict(flat)
        trial[path] = init_flat[path]
        got = run(C.unflatten(trial), jnp.asarray(tokens))
        result[path] = max(max_diff(base[k], got[k]) for k in base if k in got)
    return result


def run_checks(meta, out32, out16, params, loaded, cfg, saved):
    c = meta["checks"]
    c["checkpoint_params_roundtrip_bitwise"] = all(
        np.array_equal(a, b) for a, b in zip(
            jax.tree.leaves(np_tree(params)), jax.tree.leaves(loaded[0]), strict=False)) and (
        jax.tree.structure(np_tree(params)) == jax.tree.structure(loaded[0]))
    c["checkpoint_config_roundtrip"] = (
        C.read_checkpoint(meta["_ckpt"])["config"] == saved
        and cfg.__dict__ == A.TransformerConfig.from_saved(saved).__dict__)
    for tag, out in (("f32", out32), ("bf16", out16)):
        if "ladder_logits" in out:
            c[f"{tag}/subnetwork_vs_ladder_max_diff"] = max_diff(
                out["subnetwork_logits"], out["ladder_logits"])
        c[f"{tag}/exit_vs_subnetwork_max_diff"] = max_diff(
            out["exit_logits"], out["subnetwork_logits"])
        c[f"{tag}/full_vs_logits_max_diff"] = max_diff(out["full_logits"], out["logits"])
        c[f"{tag}/quant_vs_logits_max_diff"] = max_diff(out["quant_logits"], out["logits"])
        if "lora_logits" in out:
            c[f"{tag}/lora_vs_logits_max_diff"] = max_diff(out["lora_logits"], out["logits"])
        c[f"{tag}/all_finite"] = all(bool(np.all(np.isfinite(v))) for v in out.values())
    for key in ("logits", "hidden_states", "embedding", "confidence", "router"):
        c[f"bf16_vs_f32/{key}_max_diff"] = max_diff(out32[key], out16[key])
    c["bf16_vs_f32/logits_top1_agreement"] = float(np.mean(
        out32["logits"].argmax(-1) == out16["logits"].argmax(-1)))
    c["f32/echo_fraction_top1_is_input"] = float(np.mean(
        out32["logits"].argmax(-1) == meta["_tokens"]))
    c["greedy_tokens_equal_across_dtypes"] = bool(np.array_equal(
        out32["greedy_tokens"], out16["greedy_tokens"]))


# ---------------------------------------------------------------- one config

def build(name, spec, out_dir, argv, versions):
    seed = spec["seed"]
    rng = np.random.default_rng(seed)
    vocab = spec["fields"]["vocab_size"]
    tokens = make_tokens(rng, vocab, spec["T"])
    prompt = make_prompt(rng, vocab, spec["prompt_len"])

    cfg_made = A.TransformerConfig(**spec["fields"])
    saved = json.loads(json.dumps(dict(cfg_made.__dict__)))  # as upstream: dict(cfg.__dict__)
    cfg32_init = with_dtype(A.TransformerConfig.from_saved(saved), "float32")
    params0, other = init_params(cfg32_init, tokens, (seed, seed + 1000))
    params, perturbed, init_flat = perturb(params0, other, seed)

    ckpt = os.path.join(out_dir, f"{name}.safetensors")
    write_base_checkpoint(ckpt, params, saved, name, seed, argv)
    loaded = R.load_checkpoint(ckpt)
    cfg = loaded[1]                                  # effective config, via from_saved
    params = jax.tree.map(jnp.asarray, loaded[0])
    cfg32, cfg16 = with_dtype(cfg, "float32"), with_dtype(cfg, "bfloat16")
    params16 = to_bf16(params)

    meta = {"name": name, "upstream": versions, "saved_config": saved,
            "effective_config": json.loads(json.dumps(cfg.__dict__)),
            "covers": spec["covers"], "seed": seed, "depth": spec["depth"],
            "depth_layers": list(A.ladder_layer_indices(cfg, spec["depth"])),
            "ladder_order": list(A.ladder_order(cfg)),
            "perturbation": perturbed, "refused": {}, "checks": {},
            "kv_budget_window": int(A.kv_budget_window(cfg)),
            "quant": "Q.configure_deploy(act_bits=8, kv_bits=8); quant=True",
            "masks": "__call__/hidden_states/exit/subnetwork/ladder: causal only; "
                     "hidden_cells and heads: causal & padding",
            "files": {}}

    lora = None
    if spec.get("lora"):
        lpath = os.path.join(out_dir, f"{name}.lora.safetensors")
        lora_tree, scale, paths, same = make_lora(params, lpath, f"{name}.safetensors")
        lora = (lora_tree, scale)
        meta["lora"] = {"paths": paths, "rank": LORA_RANK, "scale": scale, "seed": LORA_SEED,
                        "B": "N(0, 0.02) from default_rng(3), sorted path order"}
        meta["checks"]["adapter_roundtrip_bitwise"] = same
        meta["files"][os.path.basename(lpath)] = content_sha256(lpath)
    if spec.get("rung"):
        rpath = os.path.join(out_dir, f"{name}.rung{spec['depth']}.safetensors")
        rung_cfg = write_rung(rpath, loaded[0], cfg, spec["depth"], name, argv)
        meta["rung_config"] = json.loads(json.dumps(rung_cfg.__dict__))
        meta["files"][os.path.basename(rpath)] = content_sha256(rpath)
    meta["files"][os.path.basename(ckpt)] = content_sha256(ckpt)

    out32, run32 = goldens(cfg32, params, tokens, prompt, spec, lora, meta, "f32")
    out16, _ = goldens(cfg16, params16, tokens, prompt, spec, lora, meta, "bf16")

    meta["_tokens"], meta["_ckpt"] = tokens, ckpt
    run_checks(meta, out32, out16, params, loaded, cfg, saved)
    del meta["_tokens"], meta["_ckpt"]
    meta["checks"]["sensitivity_reset_perturbed_leaf_to_init"] = sensitivity(
        run32, params, init_flat, perturbed, tokens)
    meta["arrays"] = sorted(out32)

    arrays = {"tokens": tokens, "prompt": prompt,
              "depth": np.int32(spec["depth"]),
              "effective_kv_window": np.int32(A.effective_kv_window(cfg)),
              "meta_json": np.asarray(json.dumps(meta, sort_keys=True, default=str))}
    for tag, out in (("f32", out32), ("bf16", out16)):
        for key, value in out.items():
            arrays[f"{tag}/{key}"] = value
    np.savez_compressed(os.path.join(out_dir, f"{name}.npz"), **arrays)
    write_command(out_dir, name, spec, argv, versions, meta)
    return meta


def write_command(out_dir, name, spec, argv, versions, meta):
    lines = [f"# {name}: made by upstream's own code through tools/upstream_goldens.py",
             f"command: {argv}",
             "regenerate: tools/upstream_goldens.sh   (from the repo root)",
             *(f"{k}: {v}" for k, v in versions.items()),
             "matmul precision: jax_default_matmul_precision=highest, JAX_PLATFORMS=cpu",
             f"seed: {spec['seed']}  depth: {spec['depth']}  "
             f"layers kept at that depth: {meta['depth_layers']}",
             f"saved config: {json.dumps(meta['saved_config'], sort_keys=True)}",
             "covers:", *(f"  - {c}" for c in spec["covers"])]
    if meta["refused"]:
        lines += ["refused by upstream (array skipped):",
                  *(f"  - {k}: {v}" for k, v in sorted(meta["refused"].items()))]
    with open(os.path.join(out_dir, f"{name}.command"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


SHARED_FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "fixtures")
SHARED_SUFFIXES = (".safetensors", ".lora.safetensors", ".npz", ".cact", ".cact.npz",
                   ".spm.model")


def copy_shared_fixture(out_dir, argv, src=SHARED_FIXTURE):
    """Copy needle-v3-tiny.* unchanged and write its .command (it was made elsewhere)."""
    names = [f"needle-v3-tiny{s}" for s in SHARED_SUFFIXES]
    for name in names:
        with open(os.path.join(src, name), "rb") as fh:
            data = fh.read()
        with open(os.path.join(out_dir, name), "wb") as fh:
            fh.write(data)
    lines = ["# needle-v3-tiny: copied unchanged from the shared fixtures",
             "source: ../shared/fixtures/needle-v3-tiny.*  (see README-v3.md there)",
             f"copied by: {argv}",
             "made by: upstream's own code, cactus-needle 3.2.8 on CPU, jax 0.10.2, "
             "flax 0.12.8, numpy 2.4.6, safetensors 0.8.0, sentencepiece 0.2.3,",
             "         jax_default_matmul_precision=highest (README-v3.md describes how)",
             "files: " + ", ".join(names),
             "covers: L 5, D 64, H 4, K 2, qk 16 / v 24, taps 3, sliding window 8 with "
             "global layers (2, 4), engram sites (1, 3), 4 mHC lanes, vocab 512,",
             "        LoRA rank 4, .cact W4 export with tokenizer, depth-3 exit/ladder; "
             "no width_logits (upstream refuses width_config for it)"]
    with open(os.path.join(out_dir, "needle-v3-tiny.command"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


TEXTS = ["The most surprising thing about", "a cat sat on the mat", "ein Hund läuft im Park",
         "weather in Paris tomorrow", "", "   spaces   and\nnewlines"]
TEXT_EXAMPLE = {"query": "What's the weather in Paris?",
                "tools": [{"name": "get_weather", "parameters": {"city": {"type": "string"}}}]}


def text_goldens(out_dir, argv, vers, src=SHARED_FIXTURE):
    """needle-v3-tiny.text.npz: upstream's tokenizer on TEXTS and on a rendered prompt, then forward_embedding,
    forward_confidence and forward_router (float32 config and params) on [BOS] + ids, right-padded with PAD (the
    heads pool over non-pad tokens under causal & key-not-pad), in one batch and each text alone."""
    name = "needle-v3-tiny"
    ckpt = os.path.join(src, f"{name}.safetensors")
    params, cfg = R.load_checkpoint(ckpt)
    cfg = with_dtype(cfg, "float32")
    m = A.SimpleAttentionNetwork(cfg)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    tok = TK.SANTokenizer(os.path.join(src, f"{name}.spm.model"))
    prompt, _ = F.render_example(TEXT_EXAMPLE)
    rows = [[BOS] + list(tok.encode(t)) for t in TEXTS + [prompt]]
    T = max(len(r) for r in rows)
    batch = np.full((len(rows), T), PAD, np.int32)
    for i, r in enumerate(rows):
        batch[i, :len(r)] = r

    @jax.jit
    def all_heads(params, t):
        return m.apply({"params": params}, t, method=lambda mod, t: (
            mod.forward_embedding(t), mod.forward_confidence(t), mod.forward_router(t)))

    def heads(tokens):
        out = all_heads(params, jnp.asarray(tokens))
        return {k: np.asarray(v, np.float32) for k, v in zip(("embedding", "confidence", "router"), out, strict=True)}

    out = {f"f32/{k}": v for k, v in heads(batch).items()}
    alone = [heads(np.asarray([r], np.int32)) for r in rows]
    for k in ("embedding", "confidence", "router"):
        out[f"f32/{k}_alone"] = np.concatenate([a[k] for a in alone])
    out["texts_json"] = np.asarray(json.dumps(TEXTS + [prompt], ensure_ascii=False))
    out["tokens"] = batch
    out["lengths"] = np.asarray([len(r) for r in rows], np.int32)
    np.savez_compressed(os.path.join(out_dir, f"{name}.text.npz"), **out)
    worst = max(max_diff(out[f"f32/{k}"], out[f"f32/{k}_alone"]) for k in ("embedding", "confidence", "router"))
    lines = [f"# {name}.text: made by upstream's own code through tools/upstream_goldens.py text_goldens()",
             f"command: {argv}",
             "regenerate: tools/upstream_goldens.sh --text-only   (from the repo root)",
             *(f"{k}: {v}" for k, v in vers.items()),
             "matmul precision: jax_default_matmul_precision=highest, JAX_PLATFORMS=cpu",
             f"inputs: {name}.safetensors via R.load_checkpoint, config dtype float32 and params cast to float32; "
             f"TK.SANTokenizer({name}.spm.model)",
             f"texts: {len(TEXTS)} strings (plain, non-ASCII, empty, spaces and newlines) and the prompt half of "
             "F.render_example (a query with one tool)",
             "ids: [BOS] + tok.encode(text), right-padded with PAD to the longest (tokens, lengths)",
             "f32/{embedding,confidence,router}: m.apply(..., tokens, method='forward_<head>') on the batch; "
             "*_alone: each row alone, unpadded",
             f"check: batch vs alone max |diff| {worst:.2e}"]
    with open(os.path.join(out_dir, f"{name}.text.command"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


WINDOW, SINKS, WINDOW_STEPS = 5, 3, 12  # kv window inside the sliding window of 8; the prompt's first 3 positions


def window_goldens(out_dir, argv, vers, src=SHARED_FIXTURE):
    """needle-v3-tiny.window.npz: run.generate's greedy loop (the full forward on the growing PAD-filled buffer)
    with hidden_cells' windowed mask passed to __call__: causal & (q - k < WINDOW | k a sink), the sinks the prompt's
    first SINKS positions; float32 config and params, prompt = needle-v3-tiny.npz's `prompt`."""
    name = "needle-v3-tiny"
    params, cfg = R.load_checkpoint(os.path.join(src, f"{name}.safetensors"))
    cfg = with_dtype(cfg, "float32")
    m = A.SimpleAttentionNetwork(cfg)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)
    with np.load(os.path.join(src, f"{name}.npz")) as z:
        prompt = np.asarray(z["prompt"], np.int32)  # (1, P)
    P = prompt.shape[1]
    M = P + WINDOW_STEPS
    pos = jnp.arange(M)
    sink = jnp.zeros((1, M), jnp.bool_).at[:, :SINKS].set(True)
    recent = ((pos[:, None] - pos[None, :]) < WINDOW)[None, None]
    mask = A.make_causal_mask(M) & (recent | sink[:, None, None, :])
    fwd = jax.jit(lambda p, t: m.apply({"params": p}, t, mask=mask))
    buf = np.full((1, M), PAD, np.int32)
    buf[:, :P] = prompt
    tokens, logits = [], []
    for t in range(P - 1, M - 1):
        step = np.asarray(fwd(params, jnp.asarray(buf)))[0, t]
        logits.append(step)
        tokens.append(int(step.argmax()))
        buf[0, t + 1] = tokens[-1]
    np.savez_compressed(os.path.join(out_dir, f"{name}.window.npz"), prompt=prompt,
                        sink=np.asarray(sink[:, :P]), kv_window=np.int32(WINDOW),
                        **{"f32/tokens": np.asarray([tokens], np.int32),
                           "f32/logits": np.asarray([logits], np.float32)})
    lines = [f"# {name}.window: made by upstream's own code through tools/upstream_goldens.py window_goldens()",
             f"command: {argv}",
             "regenerate: tools/upstream_goldens.sh --text-only   (from the repo root)",
             *(f"{k}: {v}" for k, v in vers.items()),
             "matmul precision: jax_default_matmul_precision=highest, JAX_PLATFORMS=cpu",
             f"inputs: {name}.safetensors via R.load_checkpoint, float32; prompt: {name}.npz's `prompt` ({P} ids)",
             f"loop: run.generate's (greedy, the full forward on a PAD-filled buffer of {M}), each step "
             f"m.apply(params, buf, mask=make_causal_mask(M) & (q - k < {WINDOW} | sink[k])), sink = the first "
             f"{SINKS} positions: hidden_cells' window and sink",
             f"f32/tokens (1, {WINDOW_STEPS}), f32/logits (1, {WINDOW_STEPS}, V): the chosen ids and their logits"]
    with open(os.path.join(out_dir, f"{name}.window.command"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def versions():
    v = {name: importlib.metadata.version(name)
         for name in ("cactus-needle", "jax", "jaxlib", "flax", "numpy", "safetensors",
                      "ml_dtypes")}
    v["python"] = sys.version.split()[0]
    return v


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/data/v3")
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), default=None)
    parser.add_argument("--text-only", action="store_true", help="write only needle-v3-tiny.text.* and .window.*")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    argv = os.environ.get("UPSTREAM_GOLDENS_COMMAND") or shlex.join(
        [os.path.relpath(sys.executable), *sys.argv])
    vers = versions()
    assert vers["cactus-needle"] == "3.2.8", vers
    if args.text_only:
        text_goldens(args.out, argv, vers)
        window_goldens(args.out, argv, vers)
        return
    if os.path.isdir(SHARED_FIXTURE) and not args.only:
        copy_shared_fixture(args.out, argv)
        text_goldens(args.out, argv, vers)
        window_goldens(args.out, argv, vers)
    for name in args.only or CONFIGS:
        meta = build(name, CONFIGS[name], args.out, argv, vers)
        print(f"{name}: {len(meta['arrays'])} arrays per dtype, "
              f"refused {sorted(meta['refused']) or 'nothing'}", flush=True)


if __name__ == "__main__":
    main()
