"""Greedy generation for the Flax twin: a cached loop compiled once, and upstream's recompute loop as the reference.

`generate` runs encoder, cached decoder steps and token choice as ONE jitted function
(a `lax.while_loop` over `decode_step`), so no step recompiles and the host is not
consulted between steps. `generate_recompute` is upstream's loop kept as the slow
reference: a Python loop that re-runs `decode` over the whole fixed-length buffer
(causal mask only) at every step and reads the logits at the current position.

Contract (shared with `needle_torch.generate`): tokens (B, 1 + steps) start with EOS;
each row stops at its first EOS (kept) and holds `pad_token_id` after it; the loop ends
when every row has stopped or after `max_new_tokens` steps; `suppress_tokens` are never
chosen. Shapes: B batch, S source length, L cache length (= max_new_tokens), V vocab.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from convert.generation import check_generate_args
from needle_flax.layers import make_causal_mask, make_padding_mask, precompute_rope_freqs
from needle_flax.streaming import Streamer, emit, run_streaming
from needle_flax.v1.model import SimpleAttentionNetwork


def _pick(logits, done, suppress, eos, pad):
    """Greedy choice from float32 logits (B, V): suppressed ids (bool (V,) or None) never win, finished rows pad."""
    if suppress is not None:
        logits = jnp.where(suppress, -jnp.inf, logits)
    nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # (B,), first index on ties like torch.argmax
    nxt = jnp.where(done, pad, nxt)
    return nxt, done | (nxt == eos)


_pick_jit = jax.jit(_pick)


def _as_jax(src, src_mask, pad_token_id: int):
    """Checked src and src_mask (arrays or nested lists) as jax arrays; ids fit int32 once checked. A missing
    src_mask is the padding mask of src, as upstream's generate builds it."""
    src = jnp.asarray(src)
    return src, make_padding_mask(src, pad_token_id) if src_mask is None else jnp.asarray(src_mask)


def _suppress(mask: np.ndarray | None):
    """The checked bool (V,) suppress mask as a device array (an argument: a new set never recompiles)."""
    return None if mask is None else jnp.asarray(mask)


# ----------------------------------------------------------------------------- cached (fast) path


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "stream", "return_logits"))
def _cached_loop(params, src, src_mask, eos, pad, suppress, *, model: SimpleAttentionNetwork, max_new_tokens: int,
                 stream: bool, return_logits: bool):
    """Encode, then greedy cached decoding in one while_loop; returns (tokens (B, 1+L), steps, logits or None).

    eos, pad: int32 scalars; suppress: bool (V,) or None. Only shapes and the static flags select a compilation.
    """
    cfg = model.config
    B, L = src.shape[0], max_new_tokens
    encoder_out, _ = model.apply({"params": params}, src, src_mask, method="encode")  # (B, S, D)
    cos, sin = precompute_rope_freqs(cfg.head_dim, L, cfg.rope_theta)  # (L, h/2) each
    positions = jnp.arange(L)

    def step(variables, tokens, pos, prefill: bool):
        rope = (jax.lax.dynamic_slice_in_dim(cos, pos, 1), jax.lax.dynamic_slice_in_dim(sin, pos, 1))  # (1, h/2)
        self_mask = (positions <= pos)[None, None, None, :]  # (1, 1, 1, L): cached positions up to this one
        logits, state = model.apply(variables, tokens[:, None], encoder_out, self_mask, src_mask, rope, pos, L,
                                    prefill, method="decode_step", mutable=["cache"])
        return logits[:, 0], state["cache"]  # (B, V) float32

    def record(nxt, logits, t, out, all_logits):
        out = out.at[:, t + 1].set(nxt)
        if return_logits:
            all_logits = all_logits.at[:, t].set(logits)
        if stream:
            io_callback(emit, None, nxt, ordered=True)
        return out, all_logits

    out = jnp.full((B, L + 1), pad, jnp.int32).at[:, 0].set(eos)  # (B, 1+L)
    all_logits = jnp.zeros((B, L, cfg.vocab_size), jnp.float32) if return_logits else None
    # Step 0 runs outside the loop: it creates the cache and projects the cross K/V once (prefill).
    logits, cache = step({"params": params}, out[:, 0], jnp.int32(0), True)
    nxt, done = _pick(logits, jnp.zeros((B,), jnp.bool_), suppress, eos, pad)
    out, all_logits = record(nxt, logits, 0, out, all_logits)

    def cond(state):
        t, done = state[0], state[1]
        return (t < L) & ~jnp.all(done)

    def body(state):
        t, done, out, cache, all_logits = state
        logits, cache = step({"params": params, "cache": cache}, out[:, t], t, False)
        nxt, done = _pick(logits, done, suppress, eos, pad)
        out, all_logits = record(nxt, logits, t, out, all_logits)
        return t + 1, done, out, cache, all_logits

    steps, _, out, _, all_logits = jax.lax.while_loop(cond, body, (jnp.int32(1), done, out, cache, all_logits))
    return out, steps, all_logits


def generate(model: SimpleAttentionNetwork, params, src, src_mask=None, max_new_tokens: int = 64,
             eos_token_id: int = 1, suppress_tokens: Iterable[int] | None = None, pad_token_id: int = 0, *,
             streamer: Streamer | None = None, return_logits: bool = False):
    """Greedy cached generation from EOS; tokens (B, 1 + steps) int32, or (tokens, logits (B, steps, V)).

    src: (B, S) int token ids, right-padded with pad_token_id; src_mask: bool (B, 1, 1, S) encoder/cross mask
    (None: the padding mask of src, as upstream's generate builds it; an explicit mask wins). streamer: called
    with each step's (B,) tokens as they are produced. return_logits: also return the float32 logits each step
    chose from (before suppression).
    """
    suppress = _suppress(check_generate_args(model.config, src, src_mask, max_new_tokens, eos_token_id,
                                             pad_token_id, suppress_tokens))
    src, src_mask = _as_jax(src, src_mask, pad_token_id)

    def run():
        out, steps, logits = _cached_loop(
            params, src, src_mask, jnp.int32(eos_token_id), jnp.int32(pad_token_id), suppress,
            model=model, max_new_tokens=int(max_new_tokens), stream=streamer is not None,
            return_logits=return_logits)
        return out, int(steps), logits  # int(): waits for the loop, so every streamed step has been emitted

    out, steps, logits = run_streaming(run, streamer)
    tokens = out[:, : 1 + steps]
    return (tokens, logits[:, :steps]) if return_logits else tokens


# ----------------------------------------------------------------------------- upstream recompute (reference)


@functools.partial(jax.jit, static_argnames=("model",))
def encode(params, src, src_mask=None, *, model: SimpleAttentionNetwork):
    """Jitted encoder: (B, S, D) in the compute dtype."""
    return model.apply({"params": params}, src, src_mask, method="encode")[0]


@functools.partial(jax.jit, static_argnames=("model",))
def _decode_full(params, buffer, encoder_out, cross_mask, *, model: SimpleAttentionNetwork):
    """Upstream's per-step work: decode the whole (B, T) buffer with a causal mask only; (B, T, V) float32."""
    return model.apply({"params": params}, buffer, encoder_out, make_causal_mask(buffer.shape[1]), cross_mask,
                       method="decode")


def generate_recompute(model: SimpleAttentionNetwork, params, src, src_mask=None, max_new_tokens: int = 64,
                       eos_token_id: int = 1, suppress_tokens: Iterable[int] | None = None, pad_token_id: int = 0, *,
                       streamer: Streamer | None = None, return_logits: bool = False):
    """Upstream's greedy loop (full-buffer recompute every step); same contract and return as `generate`."""
    suppress_mask = _suppress(check_generate_args(model.config, src, src_mask, max_new_tokens, eos_token_id,
                                                  pad_token_id, suppress_tokens))
    src, src_mask = _as_jax(src, src_mask, pad_token_id)
    encoder_out = encode(params, src, src_mask, model=model)
    B, L = np.shape(src)[0], int(max_new_tokens)
    buffer = np.full((B, L + 1), pad_token_id, np.int32)  # (B, 1+L): the fixed-length upstream buffer
    buffer[:, 0] = eos_token_id
    done = np.zeros(B, dtype=bool)
    eos, pad = jnp.int32(eos_token_id), jnp.int32(pad_token_id)
    step_logits = []
    for t in range(L):
        logits = np.asarray(_decode_full(params, jnp.asarray(buffer), encoder_out, src_mask, model=model)[:, t])
        nxt, new_done = _pick_jit(logits, done, suppress_mask, eos, pad)
        buffer[:, t + 1], done = np.asarray(nxt), np.asarray(new_done)
        step_logits.append(logits)
        if streamer is not None:
            streamer(buffer[:, t + 1].copy())
        if done.all():
            break
    steps = len(step_logits)
    tokens = jnp.asarray(buffer[:, : 1 + steps])
    return (tokens, jnp.asarray(np.stack(step_logits, axis=1))) if return_logits else tokens
