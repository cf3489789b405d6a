"""Cached generation for the Needle 2 Flax twin, compiled once, and upstream's recompute loop as the reference.

`generate` is upstream's cached path (NEEDLE_V2.md §6, decode.py's `batched_generate`) as ONE
jitted function: a prefill over the left-padded prompts (B, P) that writes a preallocated K/V
cache, then a `lax.while_loop` of single steps with the token choice inside, so no step
recompiles, nothing goes back to the host between steps, and a new request of the same shapes
reuses the compilation (ids, temperature, window, sinks and the seed are all traced inputs). Each
step runs the L layers as one `lax.scan` over the stacked params, with the forward's own modules
(`model.MHCLayer`; its attention writes the "cache" collection and attends over it with the
forward's arithmetic, grouped per kv head), so it compiles one layer body instead of L unrolled
copies (seconds, not minutes, at the published size) and computes what the forward computes, in
the config's dtype (float32 reproduces upstream's decode.py, which always runs in float32).
`generate_recompute` is upstream's run.py loop: the whole PAD-filled buffer re-run through
`__call__` for every new token, the logits read at the current position. The port of upstream's
own cached decoding, kept for the goldens and the benchmark, is tests/v2/upstream_decode.py.

Contract (shared with needle_torch.v2.generate): prompts (B, P) left-padded with pad_token_id,
valid from each row's first non-pad token on; each row stops at its first EOS (kept) and holds
pad_token_id after it; the loop ends when every row has stopped or after max_new_tokens.

Shapes: B batch, P prompt length (padded), G = max_new_tokens, M = P + G buffer positions,
S tokens fed in one call, W = 4·max(O) engram history, L layers, K kv heads, h head dim, V vocab,
N engram tables.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from convert.v2.config import ENGRAM_TAPS, TransformerConfig
from convert.v2.generation import check_generate_args, prompt_validity
from needle_flax.layers import ZCRMSNorm, compute_dtype, make_causal_mask, precompute_rope_freqs
from needle_flax.streaming import Streamer, emit, run_streaming
from needle_flax.v2.engram import engram_indices, shift_right
from needle_flax.v2.lanes import lane_offsets
from needle_flax.v2.model import MHCLayer, SimpleAttentionNetwork

# ----------------------------------------------------------------------------- masks


def make_decode_mask(positions, valid, window=0, sink=None):
    """The key mask of upstream's cached decoding (§6): (B, 1, S, M) bool for queries at buffer positions
    `positions` (S,) over keys 0..M-1 with validity `valid` (B, M) and sinks `sink` (B, M) or None.

    Key k is visible from query q iff k <= q ∧ valid_k [∧ (q - k < window ∨ sink_k)], or k = q: upstream's flash
    prefill ORs the diagonal so that left-pad rows see themselves (finite, exact goldens); in a single step the
    query is a generated, always valid position, so the diagonal changes nothing there. window may be traced;
    <= 0 means no window."""
    keys = jnp.arange(valid.shape[1])
    back = positions[:, None] - keys[None, :]  # (S, M): q - k
    ok = (back >= 0)[None] & valid[:, None, :]  # (B, S, M)
    near = ((back < window) | (window <= 0))[None]  # (1, S, M)
    ok = ok & (near if sink is None else near | sink[:, None, :])
    return (ok | (back == 0)[None])[:, None]  # (B, 1, S, M)


def engram_history_masks(valid, config: TransformerConfig):
    """(ngram_ok (B, T, N), tap_ok (4, B, T)) from a token history's validity (B, T), as upstream's decode reads
    them: table k's n-gram is valid where its oldest token (o - 1 back) is, tap j where the position j·max(O) back
    is. For validity that starts at each row's first real token this is engram_masks(causal ∧ key-valid)."""
    E, dil = config.engram_heads_resolved, config.engram_dilation
    ngram_ok = jnp.stack([shift_right(valid, o - 1) for o in config.engram_orders for _ in range(E)], axis=-1)
    tap_ok = jnp.stack([shift_right(valid, j * dil) for j in range(ENGRAM_TAPS)])
    return ngram_ok, tap_ok


# ----------------------------------------------------------------------------- one cached step


class DecodeCache(NamedTuple):
    """One request's cached-decoding state (upstream's decode.py, §6), preallocated for M buffer positions.

    k, v: (L, B, K, M, h): K after k_norm and RoPE, V as projected, rounded to the compute dtype (stored as
    float32 on CPU, exactly). hist (B, W + M) int32 and valid (B, W + M) bool: the token at every
    buffer position and upstream's `valid` (key_valid and hist_valid), behind W leading zeros / False, so the
    engram's history window [pos - W, pos + S) is one slice at every position. sink (B, M) bool and window
    (0-d int32, 0 = off) shape the attention mask only. cos, sin: (M, h/2) RoPE tables."""

    k: jax.Array
    v: jax.Array
    hist: jax.Array
    valid: jax.Array
    sink: jax.Array
    window: jax.Array
    cos: jax.Array
    sin: jax.Array


def new_cache(model: SimpleAttentionNetwork, batch: int, max_len: int, valid=None, sink=None,
              kv_window=0) -> DecodeCache:
    """An empty DecodeCache for `batch` rows and max_len positions. valid: (B, max_len) bool, upstream's `valid`
    (None: all True); sink: (B, max_len) bool or None (no sinks); kv_window: an int or a traced 0-d int."""
    cfg, W = model.config, model.config.engram_history
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    valid = jnp.ones((batch, max_len), jnp.bool_) if valid is None else jnp.asarray(valid, jnp.bool_)
    sink = jnp.zeros((batch, max_len), jnp.bool_) if sink is None else jnp.asarray(sink, jnp.bool_)
    cos, sin = precompute_rope_freqs(cfg.head_dim, max_len, cfg.rope_theta)
    # float32 buffers on CPU hold the compute dtype's values exactly: XLA:CPU converts bf16 to f32 (for the
    # attention's float32 sums) ~3x slower than it reads float32, which made bf16 steps slower than float32 ones.
    k = jnp.zeros(shape, jnp.float32 if jax.default_backend() == "cpu" else compute_dtype(cfg))
    return DecodeCache(k, jnp.zeros_like(k), jnp.zeros((batch, W + max_len), jnp.int32),
                       jnp.pad(valid, ((0, 0), (W, 0))), sink, jnp.asarray(kv_window, jnp.int32), cos, sin)


def _routing(stack_params, config: TransformerConfig):
    """Every layer's mHC routing params and lane offsets (each with L on axis 0), as Stack hands them to its scan,
    and the site flags (L, sites) (None without sites)."""
    L, n = config.num_layers, config.mhc_lanes
    hc = {name: stack_params[f"mhc_{name}"] for name in ("phi_pre", "phi_post", "phi_res", "b_pre", "b_post",
                                                          "b_res", "a_pre", "a_post", "a_res")}
    pre_off, post_off = lane_offsets(L, n)
    hc |= {"pre_off": jnp.asarray(pre_off), "post_off": jnp.asarray(post_off)}
    if not config.num_sites:
        return hc, None
    flags = np.zeros((L, config.num_sites), np.float32)  # flags[l, g] = 1 iff site g sits at layer l
    for g, layer in enumerate(config.engram_layers):
        flags[layer, g] = 1.0
    return hc, jnp.asarray(flags)


def _sites(module, indices, ngram_ok, tap_ok):
    return [engram(indices, ngram_ok, tap_ok) for engram in module.engrams]


def decode_step(model: SimpleAttentionNetwork, params, cache: DecodeCache, tokens, pos, last_only: bool = False):
    """Feed tokens (B, S) at buffer positions pos..pos+S-1: (float32 logits (B, S, V), or (B, 1, V) with
    last_only; the updated cache).

    pos may be traced. pos 0 with the prompts is upstream's prefill, S = 1 a step. Attention reads the whole
    buffer (later positions masked), so every shape is fixed; RoPE reads the absolute buffer position (left
    padding shifts it, as upstream's). The engram reads the history window of W tokens before the chunk with
    validity alone (decode.py's rule: no attention mask, no window). Runs in the config's dtype, no quant."""
    cfg, dt = model.config, compute_dtype(model.config)
    B, S = tokens.shape
    W = cfg.engram_history
    positions = pos + jnp.arange(S)  # (S,)
    hist = jax.lax.dynamic_update_slice(cache.hist, tokens.astype(jnp.int32), (0, W + pos))
    rope = jax.lax.dynamic_slice_in_dim(cache.cos, pos, S), jax.lax.dynamic_slice_in_dim(cache.sin, pos, S)
    mask = make_decode_mask(positions, cache.valid[:, W:], cache.window, cache.sink)  # (B, 1, S, M)

    variables = {"params": params}
    x0 = model.apply(variables, tokens, method="_embed")  # (B, S, D)
    engram_kv = None
    if cfg.num_sites:
        window = jax.lax.dynamic_slice_in_dim(hist, pos, W + S, axis=1)  # (B, W + S): history pos - W .. pos + S - 1
        window_valid = jax.lax.dynamic_slice_in_dim(cache.valid, pos, W + S, axis=1)
        pairs = model.apply(variables, engram_indices(window, cfg), *engram_history_masks(window_valid, cfg),
                            method=_sites)
        # every site's key and value of the chunk's rows, (sites, B, S, D) each
        engram_kv = (jnp.stack([k[:, -S:] for k, _ in pairs]), jnp.stack([v[:, -S:] for _, v in pairs]))

    hc, flags = _routing(params["stack"], cfg)
    layer_module = MHCLayer(cfg)

    def layer(carry, xs):
        x, k, v = carry
        index, block, hc_l, flags_l = xs
        (x, _), state = layer_module.apply(
            {"params": {"block": block}, "cache": {"block": {"self_attn": {"k": k, "v": v}}}},
            x, (flags_l, hc_l), mask, rope, False, engram_kv, cache=(index, pos), mutable=["cache"])
        new = state["cache"]["block"]["self_attn"]
        return (x, new["k"], new["v"]), None

    x = jnp.broadcast_to(x0.astype(dt)[:, :, None, :], (B, S, cfg.mhc_lanes, cfg.d_model))  # (B, S, n, D)
    xs = (jnp.arange(cfg.num_layers), params["stack"]["layers"]["block"], hc, flags)
    (x, k, v), _ = jax.lax.scan(layer, (x, cache.k, cache.v), xs)
    x = ZCRMSNorm(dtype=dt).apply({"params": params["stack"]["final_norm"]}, jnp.mean(x, axis=2))  # (B, S, D)
    if last_only:
        x = x[:, -1:]
    logits = x.astype(jnp.float32) @ params["embedding"]["embedding"].T  # (B, S, V) float32, tied
    return logits, cache._replace(k=k, v=v, hist=hist)


# ----------------------------------------------------------------------------- token choice


def pick(logits, done, eos, pad, key=None, temperature=1.0):
    """The next token of every row from float32 logits (B, V): (token (B,) int32, done (B,), log-probability (B,)).

    Greedy (key None): argmax, the first index on ties. With a PRNG key: jax.random.categorical(key,
    logits / max(temperature, 1e-6)), upstream's rule. Rows already done take `pad` and log-probability 0. The
    log-probability is log_softmax of the *unscaled* logits at the chosen token, as upstream's batched path
    reports it. eos -1 never matches (no early stop)."""
    if key is None:
        nxt = jnp.argmax(logits, axis=-1)
    else:
        nxt = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6), axis=-1)
    nxt = nxt.astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), nxt[:, None], axis=-1)[:, 0]  # (B,)
    nxt = jnp.where(done, pad, nxt)
    return nxt, done | (nxt == eos), jnp.where(done, 0.0, logp)


_pick_jit = jax.jit(pick)


class _Request(NamedTuple):
    """Checked inputs as device arrays: prompts (B, P) int32, valid (B, M), sink (B, M), and the scalars."""

    prompts: jax.Array
    valid: jax.Array
    sink: jax.Array
    window: jax.Array
    eos: jax.Array
    pad: jax.Array
    temperature: jax.Array
    key: jax.Array | None


def _prepare(model, tokens, max_new_tokens, kv_window, sink, temperature, seed, eos_token_id,
             pad_token_id) -> _Request:
    """The arguments checked as given (before any conversion), then as device arrays. seed None: one drawn from
    NumPy's global generator (so np.random.seed makes a run repeatable)."""
    prompts = check_generate_args(model.config, tokens, max_new_tokens, kv_window, sink, temperature, seed,
                                  eos_token_id, pad_token_id)
    G = int(max_new_tokens)
    valid = np.pad(prompt_validity(prompts, pad_token_id), ((0, 0), (0, G)), constant_values=True)  # (B, M)
    sink = np.zeros(valid.shape, bool) if sink is None else np.pad(np.asarray(sink) != 0, ((0, 0), (0, G)))
    key = None
    if temperature > 0:
        key = jax.random.PRNGKey(np.random.randint(0, 2**62) if seed is None else int(seed))
    eos = -1 if eos_token_id is None else int(eos_token_id)
    return _Request(jnp.asarray(prompts, jnp.int32), jnp.asarray(valid), jnp.asarray(sink),
                    jnp.int32(kv_window), jnp.int32(eos), jnp.int32(pad_token_id), jnp.float32(temperature), key)


def _next_key(key):
    """(key for the rest of the request, key for this choice): the key is split once per choice."""
    if key is None:
        return None, None
    key, sub = jax.random.split(key)
    return key, sub


# ----------------------------------------------------------------------------- cached (fast) path


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "stream", "return_logits",
                                             "return_logprobs"))
def _cached_loop(params, request: _Request, *, model: SimpleAttentionNetwork, max_new_tokens: int, stream: bool,
                 return_logits: bool, return_logprobs: bool):
    """Prefill, then single steps in a while_loop: (tokens (B, G), steps, logits (B, G, V) or None, logp (B, G)
    or None). Only shapes, greedy-or-sampled and the static flags select a compilation."""
    r = request
    B, P = r.prompts.shape
    G = max_new_tokens
    cache = new_cache(model, B, P + G, r.valid, r.sink, r.window)
    logits, cache = decode_step(model, params, cache, r.prompts, 0, last_only=True)

    def choose(t, logits, done, key, out, all_logits, all_logp):
        key, sub = _next_key(key)
        nxt, done, logp = pick(logits, done, r.eos, r.pad, sub, r.temperature)
        out = out.at[:, t].set(nxt)
        if return_logits:
            all_logits = all_logits.at[:, t].set(logits)
        if return_logprobs:
            all_logp = all_logp.at[:, t].set(logp)
        if stream:
            io_callback(emit, None, nxt, ordered=True)
        return done, key, out, all_logits, all_logp

    out = jnp.full((B, G), r.pad, jnp.int32)  # (B, G)
    all_logits = jnp.zeros((B, G, logits.shape[-1]), jnp.float32) if return_logits else None
    all_logp = jnp.zeros((B, G), jnp.float32) if return_logprobs else None
    state = choose(0, logits[:, 0], jnp.zeros((B,), jnp.bool_), r.key, out, all_logits, all_logp)

    def cond(carry):
        t, done = carry[0], carry[1]
        return (t < G) & ~jnp.all(done)

    def body(carry):
        t, done, key, out, all_logits, all_logp, cache = carry
        # feed token t - 1 at position P + t - 1; its logits choose token t
        fed = jax.lax.dynamic_slice_in_dim(out, t - 1, 1, axis=1)  # (B, 1)
        logits, cache = decode_step(model, params, cache, fed, P + t - 1)
        done, key, out, all_logits, all_logp = choose(t, logits[:, 0], done, key, out, all_logits, all_logp)
        return t + 1, done, key, out, all_logits, all_logp, cache

    steps, _, _, out, all_logits, all_logp, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), *state, cache))
    return out, steps, all_logits, all_logp


def _result(out, steps: int, logits, logp, return_logits: bool, return_logprobs: bool):
    extra = []
    if return_logits:
        extra.append(logits[:, :steps])  # (B, steps, V) float32
    if return_logprobs:
        extra.append(logp[:, :steps])  # (B, steps) float32
    return (out, *extra) if extra else out


def generate(model: SimpleAttentionNetwork, params, tokens, max_new_tokens: int = 64, *, kv_window: int = 0,
             temperature: float = 0.0, seed: int | None = None, sink=None, eos_token_id: int | None = 1,
             pad_token_id: int = 0, return_logits: bool = False, return_logprobs: bool = False,
             streamer: Streamer | None = None):
    """Cached generation: the new tokens (B, max_new_tokens) int32, plus (logits, logprobs) on request.

    tokens: (B, P) prompts (BOS included), left-padded with pad_token_id as upstream's batched path lays them out;
    validity runs from each row's first non-pad token on (upstream's `valid`: the attention's key_valid and the
    engram's hist_valid). P + max_new_tokens <= config.max_seq_len. Prefill is one pass over the padded prompts
    with the mask (causal ∧ valid) ∨ diagonal (upstream's flash prefill: pad rows see themselves); each step
    then attends over the cache. Runs in the config's dtype with the params as given; upstream's own decode
    always runs in float32 (a float32 config reproduces it).
    kv_window: attention sees the last kv_window positions (the query's own included) plus the `sink` positions
    ((B, P) bool over the prompts); as upstream's decode.py the window touches the attention only, never the
    engram, whose n-grams and taps read the token history of W = 4·max(O) positions with validity alone. Below
    upstream's agreement limit (kv_window <= 3·max(O), 9 for orders (2, 3)) this therefore differs from
    upstream's forward with a windowed mask, which also windows the engram (NEEDLE_V2.md §6, differences 2): it
    follows decode.py, the cached path upstream ships.
    temperature: 0 is greedy (argmax, ties to the first index); above 0, jax.random.categorical(logits / max(T,
    1e-6)) with a key from `seed` split once per step (None: a seed from NumPy's global generator). Greedy tokens
    are upstream's exactly; sampled ones follow its distribution. Each row stops at its first eos_token_id (kept;
    None: never) and holds pad_token_id after it; the loop ends when every row has stopped.
    return_logits: also the float32 logits (B, steps, V) each token was chosen from (steps <= max_new_tokens:
    fewer when every row stopped early); return_logprobs: the chosen tokens' log_softmax of the *unscaled*
    logits (B, steps), 0 after a row's EOS. The result is (tokens, logits, logprobs) with the requested ones.
    streamer: called with each step's (B,) tokens as numpy, in order, as they are produced.
    Compiles once per (model, batch, prompt length, max_new_tokens, greedy or sampled, the return and stream
    flags); a new request of those shapes reuses it.
    """
    request = _prepare(model, tokens, max_new_tokens, kv_window, sink, temperature, seed, eos_token_id,
                       pad_token_id)

    def loop():
        out, steps, logits, logp = _cached_loop(params, request, model=model, max_new_tokens=int(max_new_tokens),
                                                stream=streamer is not None, return_logits=return_logits,
                                                return_logprobs=return_logprobs)
        return out, int(steps), logits, logp  # int(): waits for the loop, so every streamed step has been emitted

    return _result(*run_streaming(loop, streamer), return_logits, return_logprobs)


# ----------------------------------------------------------------------------- upstream recompute (reference)


@functools.partial(jax.jit, static_argnames=("model",))
def _forward_at(params, buf, mask, pos, *, model: SimpleAttentionNetwork):
    """Upstream's per-step work: `__call__` on the whole (B, M) buffer, the float32 logits (B, V) at `pos`."""
    logits = model.apply({"params": params}, buf, mask)  # (B, M, V)
    return jax.lax.dynamic_index_in_dim(logits, pos, axis=1, keepdims=False)


def generate_recompute(model: SimpleAttentionNetwork, params, tokens, max_new_tokens: int = 64, *,
                       temperature: float = 0.0, seed: int | None = None, eos_token_id: int | None = 1,
                       pad_token_id: int = 0, return_logits: bool = False, return_logprobs: bool = False,
                       streamer: Streamer | None = None):
    """Upstream's run.py loop, the reference: the model's `__call__` on a PAD-filled buffer (B, P + G) re-run for
    every new token, in the config's dtype, the logits read at the current position. Same contract and results
    as `generate` (no kv_window: run.py has none); a seed draws the same keys, so sampled runs choose the same
    tokens.

    The mask is upstream's causal one; for left-padded rows it is (causal ∧ valid) ∨ diagonal, the cached
    path's, so pad keys stay unseen (for unpadded prompts the two are the same mask). The positions after the
    current one hold pads that the causal mask hides, as in run.py."""
    r = _prepare(model, tokens, max_new_tokens, 0, None, temperature, seed, eos_token_id, pad_token_id)
    B, P = r.prompts.shape
    G = int(max_new_tokens)
    M = P + G
    buf = np.full((B, M), pad_token_id, np.int32)  # (B, M): the fixed-length upstream buffer
    buf[:, :P] = np.asarray(r.prompts)
    causal = make_causal_mask(M)  # (1, 1, M, M)
    mask = (causal & r.valid[:, None, None, :]) | jnp.eye(M, dtype=jnp.bool_)[None, None]  # (B, 1, M, M)
    out = np.full((B, G), pad_token_id, np.int32)
    done = jnp.zeros((B,), jnp.bool_)
    key, step_logits, step_logp = r.key, [], []
    for t in range(G):
        if t:
            buf[:, P + t - 1] = out[:, t - 1]
        logits = _forward_at(params, jnp.asarray(buf), mask, P - 1 + t, model=model)  # (B, V) float32
        key, sub = _next_key(key)
        nxt, done, logp = _pick_jit(logits, done, r.eos, r.pad, sub, r.temperature)
        out[:, t] = np.asarray(nxt)
        step_logits.append(logits)
        step_logp.append(logp)
        if streamer is not None:
            streamer(out[:, t].copy())
        if bool(done.all()):
            break
    steps = len(step_logits)
    logits = jnp.stack(step_logits, axis=1) if return_logits else None  # (B, steps, V)
    logp = jnp.stack(step_logp, axis=1) if return_logprobs else None  # (B, steps)
    return _result(jnp.asarray(out), steps, logits, logp, return_logits, return_logprobs)
