"""Cached generation for the Needle 2 torch twin (`SimpleAttentionNetwork.generate` calls this), and the reference.

`generate` is upstream's cached path (NEEDLE_V2.md §6, decode.py's `batched_generate`): the
prompts, left-padded into (B, P), go through one prefill that writes a preallocated K/V cache,
then one token per step; RoPE reads absolute buffer positions, so left padding shifts them, as
upstream's does. `generate_recompute` is upstream's run.py loop (the whole PAD-filled buffer of
length P + G re-run every step, logits read at the current position): the reference the cached
path must reproduce. Both share the contract below and one choice rule (`pick`).

Shapes: B batch, P prompt length (padded), G = max_new_tokens, M = P + G buffer positions, S tokens fed in one
call, W = 4·max(O) engram history, L layers, K kv heads, h head dim, V vocab, N engram tables.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from convert.errors import GenerationError
from convert.v2.config import ENGRAM_TAPS, TransformerConfig
from convert.v2.generation import check_generate_args, prompt_validity
from needle_torch.fast.kernels import CompiledStep, prefill_rows
from needle_torch.fast.seam import fast_paths
from needle_torch.layers import make_causal_mask
from needle_torch.v2.engram import shift_right

Streamer = Callable[[Tensor], None]  # called with the (B,) int64 CPU tokens of each step, in order



# ----------------------------------------------------------------------------- masks and the cache


def make_decode_mask(positions: Tensor, valid: Tensor, window: int = 0, sink: Tensor | None = None) -> Tensor:
    """The key mask of upstream's cached decoding (§6): (B, 1, S, M) bool for queries at buffer positions
    `positions` (S,) over keys 0..M-1 with validity `valid` (B, M) and sinks `sink` (B, M) or None.

    Key k is visible from query q iff k <= q ∧ valid_k [∧ (q - k < window ∨ sink_k)], or k = q: upstream's flash
    prefill ORs the diagonal so that left-pad rows see themselves (finite, exact goldens); in a single step the
    query is a generated, always valid position, so the diagonal changes nothing there."""
    keys = torch.arange(valid.shape[1], device=valid.device)
    back = positions[:, None] - keys[None, :]  # (S, M): q - k
    ok = (back >= 0)[None] & valid[:, None, :]  # (B, S, M)
    if window > 0:
        near = (back < window)[None]  # (1, S, M)
        ok = ok & (near if sink is None else near | sink[:, None, :])
    return (ok | (back == 0)[None])[:, None]  # (B, 1, S, M)


def engram_history_masks(valid: Tensor, config: TransformerConfig) -> tuple[Tensor, Tensor]:
    """(ngram_ok (B, T, N), tap_ok (4, B, T)) bool from token validity (B, T), as cached decoding builds them.

    Upstream's decode reads no attention mask: ngram_ok[..., k] = valid shifted right by o - 1 (table k's order
    o) and tap_ok[j] = valid shifted by j·max(O), False before the start. For validity that starts at each row's
    first real token (left padding) this is engram_masks of causal ∧ key-valid; a kv_window never enters it
    (NEEDLE_V2.md §6, differences 2)."""
    E, dil = config.engram_heads_resolved, config.engram_dilation
    ngram = [shift_right(valid, order - 1) for order in config.engram_orders for _ in range(E)]
    taps = [shift_right(valid, j * dil) for j in range(ENGRAM_TAPS)]
    return torch.stack(ngram, dim=-1), torch.stack(taps, dim=0)


@dataclass
class DecodeCache:
    """One cached-decoding request's state (upstream's decode.py, §6), preallocated for M buffer positions.

    k, v: one (B, K, M, h) buffer per layer, in the compute dtype: K after k_norm and RoPE, V as projected. Separate
    tensors, not views of one: a compiled region writes into its inputs correctly only then (torch 2.13). The
    forward rounds both to the compute dtype before attending, so this holds exactly what it would attend over
    (upstream's decode keeps float32 caches because it runs everything in float32; so does a float32 model here).
    hist (B, W + M) int64 and valid (B, W + M) bool: the token at every buffer position and upstream's `valid`
    (key_valid and hist_valid), behind W = 4·max(O) leading zeros / False, so the engram's history window
    [pos - W, pos + S) is one slice at every position. sink (B, M) bool or None and window (kv_window, 0 = off)
    shape the attention mask only. rope: cos, sin (M, h/2), and offsets: every layer's lane_offsets, computed
    once. logits_weight: the tied embedding upcast to float32 once per request (None: E itself is read, a float32
    model's, or where a compiled step reads it in place)."""

    k: list[Tensor]
    v: list[Tensor]
    hist: Tensor
    valid: Tensor
    sink: Tensor | None
    window: int
    rope: tuple[Tensor, Tensor]
    offsets: list[tuple[Tensor, Tensor]]
    logits_weight: Tensor | None = None

    def rows(self, start: int, stop: int) -> DecodeCache:
        """The same state for batch rows start..stop-1: views, so writing through it fills this cache."""
        return replace(self, k=[t[start:stop] for t in self.k], v=[t[start:stop] for t in self.v],
                       hist=self.hist[start:stop], valid=self.valid[start:stop],
                       sink=None if self.sink is None else self.sink[start:stop])


# ----------------------------------------------------------------------------- one step and its choice


def pick(logits: Tensor, done: Tensor, eos: int | Tensor, pad: int | Tensor, noise: Tensor | None = None,
         inv_temp: float | Tensor = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """The next token of every row from float32 logits (B, V): (token (B,), done (B,), log-probability (B,)).

    Greedy: argmax, the first index on ties (jnp.argmax's rule). With noise (B, V) of standard Gumbel draws: the
    Gumbel-max form of categorical(logits · inv_temp), inv_temp = 1 / max(temperature, 1e-6) as upstream's.
    Rows already done take `pad` and log-probability 0. The log-probability is log_softmax of the *unscaled*
    logits at the chosen token, as upstream's batched path reports it. eos, pad: ints or 0-d int64 tensors
    (graph inputs under torch.compile); eos -1 never matches (no early stop)."""
    scores = logits if noise is None else logits * inv_temp + noise
    nxt = scores.argmax(dim=-1)  # (B,)
    logp = logits.log_softmax(dim=-1).gather(-1, nxt[:, None])[:, 0]  # (B,)
    nxt = torch.where(done, pad, nxt)
    return nxt, done | (nxt == eos), torch.where(done, 0.0, logp)


def _prefill(model: nn.Module, prompts: Tensor, cache) -> Tensor:
    """The prefill pass over the left-padded prompts: the float32 logits (B, V) that choose token 0."""
    return model.decode_step(prompts, cache, 0, last_only=True)[:, 0]


def prefill_in_chunks(model: nn.Module, prompts: Tensor, cache, compiled: bool = False) -> Tensor:
    """_prefill over chunks of kernels.prefill_rows prompts, each writing its rows of the cache (the same logits:
    a prompt's prefill reads only its own row). compiled: each chunk shape's pass as one torch.compile graph."""
    B, P = prompts.shape
    rows = prefill_rows(B, P, prompts.device)
    passes: dict[int, Callable] = {}  # one CompiledStep per chunk shape: its later calls skip the guards
    out = []
    for start in range(0, B, rows):
        n = min(rows, B - start)
        if n not in passes:
            passes[n] = CompiledStep(_prefill) if compiled else _prefill
        out.append(passes[n](model, prompts[start:start + n], cache if n == B else cache.rows(start, start + n)))
    return out[0] if len(out) == 1 else torch.cat(out)


def compile_choice(compile: bool | str) -> tuple[bool, bool]:
    """(compile the steps, compile the prefill) for generate's `compile` argument: False, True or "all"."""
    if compile is False or compile is True:
        return compile, False
    if compile == "all":
        return True, True
    raise GenerationError(f"compile={compile!r} is not a choice; use False, True (the decoding steps) or 'all' "
                          "(the prefill too)")


def _step_and_pick(model: nn.Module, token: Tensor, cache, pos: int | Tensor, done: Tensor, eos: Tensor,
                   pad: Tensor, noise: Tensor | None, inv_temp: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One cached step and its choice, one graph for torch.compile: (logits (B, V), next (B,), done, logp)."""
    logits = model.decode_step(token, cache, pos)[:, 0]  # (B, V)
    return (logits, *pick(logits, done, eos, pad, noise, inv_temp))


class _Sampler:
    """Gumbel noise for temperature sampling from a seeded torch.Generator (None: greedy, no noise).

    Drawn on the host side of the step (one (B, V) uniform draw per step), so eager, compiled and recompute runs
    with one seed draw the same noise and choose the same tokens. torch's stream is not JAX's: sampled tokens
    match upstream's only in distribution, never token for token."""

    def __init__(self, temperature: float, seed: int | None, shape: tuple[int, int], device: torch.device):
        self.shape, self.device = shape, device
        self.generator = None
        if temperature > 0:
            self.generator = torch.Generator(device=device)
            # seed None: drawn from torch's global generator, so torch.manual_seed makes a run repeatable too.
            self.generator.manual_seed(int(torch.randint(0, 2**62, ())) if seed is None else int(seed))
        self.inv_temp = torch.tensor(1.0 / max(float(temperature), 1e-6), device=device)

    def noise(self) -> Tensor | None:
        if self.generator is None:
            return None
        u = torch.rand(self.shape, generator=self.generator, device=self.device)  # [0, 1): u = 0 gives -inf
        return -torch.log(-torch.log(u))


Advance = Callable[[int, Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor, Tensor, Tensor]]


def _loop(advance: Advance, sampler: _Sampler, B: int, G: int, device: torch.device, eos: int, pad: int,
          streamer: Streamer | None, return_logits: bool, return_logprobs: bool):
    """Up to G choices; advance(t, out, done, noise) gives (logits (B, V), next, done, logp) for new token t, out
    (B, G) holding the tokens before it. The loop ends early once every row has chosen EOS; the tokens after a
    row's EOS are `pad`."""
    out = torch.full((B, G), pad, dtype=torch.long, device=device)  # (B, G)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    logits_steps, logp_steps = [], []
    for t in range(G):
        logits, nxt, done, logp = advance(t, out, done, sampler.noise())
        out[:, t] = nxt
        if return_logits:
            logits_steps.append(logits)
        if return_logprobs:
            logp_steps.append(logp)
        if streamer is not None:
            streamer(nxt.cpu())
        if eos >= 0 and bool(done.all()):  # one host sync per step; the streamer needs the tokens anyway
            break
    extra = []
    if return_logits:
        extra.append(torch.stack(logits_steps, dim=1))  # (B, steps, V) float32
    if return_logprobs:
        extra.append(torch.stack(logp_steps, dim=1))  # (B, steps) float32
    return (out, *extra) if extra else out


def _prepare(model: nn.Module, tokens, max_new_tokens, kv_window, sink, temperature, seed, eos_token_id,
             pad_token_id) -> tuple[Tensor, Tensor, Tensor | None, _Sampler, int]:
    """Checked inputs on the model's device: (prompts (B, P) int64, valid (B, M), sink (B, M) or None, sampler,
    eos id (-1: none)). The arguments are checked as given, before any conversion."""
    prompts = check_generate_args(model.config, tokens, max_new_tokens, kv_window, sink, temperature, seed,
                                  eos_token_id, pad_token_id)
    B, P = prompts.shape
    G = int(max_new_tokens)
    device = model.device
    valid = torch.from_numpy(prompt_validity(prompts, pad_token_id)).to(device)
    valid = F.pad(valid, (0, G), value=True)  # (B, M): every generated position is valid
    if sink is not None:
        sink = F.pad(torch.as_tensor(sink, device=device) != 0, (0, G))  # (B, M): generated positions are no sinks
    sampler = _Sampler(float(temperature), seed, (B, model.config.vocab_size), device)
    eos = -1 if eos_token_id is None else int(eos_token_id)
    return torch.from_numpy(prompts).to(device), valid, sink, sampler, eos


@torch.inference_mode()
def generate(model: nn.Module, tokens, max_new_tokens: int = 64, *, kv_window: int = 0, temperature: float = 0.0,
             seed: int | None = None, sink=None, eos_token_id: int | None = 1, pad_token_id: int = 0,
             return_logits: bool = False, return_logprobs: bool = False, streamer: Streamer | None = None,
             compile: bool | str = False, fast: bool = True):
    """Cached generation: the new tokens LongTensor (B, max_new_tokens), plus (logits, logprobs) on request.

    tokens: (B, P) prompts (BOS included), left-padded with pad_token_id as upstream's batched path lays them out;
    validity runs from each row's first non-pad token on (upstream's `valid`: the attention's key_valid and the
    engram's hist_valid). P + max_new_tokens <= config.max_seq_len. Prefill is one pass over the padded prompts
    with the mask (causal ∧ valid) ∨ diagonal (upstream's flash prefill: pad rows see themselves), run in chunks
    of rows of at most kernels.PREFILL_TOKENS tokens on CPU (the same function: for glibc's allocator); each
    step then attends over the cache. Runs in the model's dtype and on its device (CPU or CUDA; the code is
    device-agnostic, only CPU is tested here); upstream's own decode always runs in float32.
    kv_window: attention sees the last kv_window positions (the query's own included) plus the `sink` positions
    ((B, P) bool over the prompts); as upstream's decode.py the window touches the attention only, never the
    engram, whose n-grams and taps read the token history of W = 4·max(O) positions with validity alone. Below
    upstream's agreement limit (kv_window <= 3·max(O), 9 for orders (2, 3)) this therefore differs from
    upstream's forward with a windowed mask, which also windows the engram (NEEDLE_V2.md §6, differences 2): it
    follows decode.py, the cached path upstream ships.
    temperature: 0 is greedy (argmax, ties to the first index); above 0, categorical(logits / max(T, 1e-6))
    through Gumbel noise from a torch.Generator seeded with `seed` (None: a seed from torch's global generator).
    torch's random stream cannot reproduce JAX's `categorical`: sampled tokens follow upstream's distribution,
    not its draws; greedy tokens are upstream's exactly. Each row stops at its first eos_token_id (kept; None:
    never) and holds pad_token_id after it; the loop ends when every row has stopped.
    return_logits: also the float32 logits (B, steps, V) each token was chosen from (steps <= max_new_tokens:
    fewer when every row stopped early); return_logprobs: the chosen tokens' log_softmax of the *unscaled*
    logits (B, steps), 0 after a row's EOS. The result is (tokens, logits, logprobs) with the requested ones.
    streamer: called with each step's (B,) tokens on the CPU, in order.
    compile: True compiles the decoding steps, "all" the prefill too (once per chunk rows, prompt length, buffer
    length and dtype: it pays where requests repeat a shape). With fast on, a CPU step of at most
    cpu_decode.max_rows rows (float32 or bf16, the twin's own modules without hooks or LoRA wrappers) runs through
    the C++ kernels of cpu_decode instead of a graph; otherwise every step and its choice is one torch.compile graph
    (a 0-d position tensor and a static cache, so one graph serves every step; the lane layer a nested compile
    region traced once for all layers), in which needle_torch.fast's forms replace the pieces they apply to.
    Compiles once per (batch, buffer length, dtype, greedy or sampled); later requests reuse the graph, guards
    checked on their first step only (kernels.CompiledStep: not for concurrent threads). float32 logits stay within
    1e-6 of eager (upstream's within 1e-5); in bfloat16 the compiled step keeps some intermediates in float32, as
    XLA's jit does, so logits move by ~1-3e-2 relative from eager, within upstream's own eager-vs-jit gap, and a
    greedy row can take another token where bf16 does not decide the choice.
    fast: the speed forms of needle_torch.fast (C++ kernels, packed and reduced products, the CPU's bf16 path);
    False runs the plain modules as written, eagerly or under a plain torch.compile (no inductor options): the
    baseline every fast form is measured against. The same function either way (float32 sums in another order).
    """
    with fast_paths(model, fast) as forms:
        return _generate(model, tokens, max_new_tokens, kv_window, temperature, seed, sink, eos_token_id,
                         pad_token_id, return_logits, return_logprobs, streamer, compile, forms)


def _generate(model, tokens, max_new_tokens, kv_window, temperature, seed, sink, eos_token_id, pad_token_id,
              return_logits, return_logprobs, streamer, compile, forms):
    """generate's body, run inside fast_paths(model, fast); forms: needle_torch.fast.v2 with fast on, else None."""
    step_compiled, prefill_compiled = compile_choice(compile)
    prompts, valid, sink, sampler, eos = _prepare(model, tokens, max_new_tokens, kv_window, sink, temperature,
                                                  seed, eos_token_id, pad_token_id)
    B, P = prompts.shape
    G, device = int(max_new_tokens), model.device
    # fused: the steps run through the fast layer's C++ kernels instead of a torch.compile graph
    fused = forms is not None and forms.prepare(model, B, step_compiled, prefill_compiled)
    traced = step_compiled and not fused
    cache = model.new_cache(B, P + G, valid, sink, kv_window)
    if forms is not None:
        cache = forms.ready(model, cache, traced, fused)
    prefill = prefill_in_chunks(model, prompts, cache, prefill_compiled)  # (B, V) float32: chooses token 0
    # 0-d tensors: the ids are graph inputs (one graph for any ids), positions too (one graph for every step).
    eos_t, pad_t = (torch.tensor(i, device=device) for i in (eos, pad_token_id))
    step = CompiledStep(_step_and_pick) if traced else _step_and_pick
    positions = torch.arange(P, P + G, device=device) if traced else range(P, P + G)

    def advance(t: int, out: Tensor, done: Tensor, noise: Tensor | None):
        if t == 0:
            return (prefill, *pick(prefill, done, eos_t, pad_t, noise, sampler.inv_temp))
        # feed token t - 1 at position P + t - 1
        return step(model, out[:, t - 1:t], cache, positions[t - 1], done, eos_t, pad_t, noise, sampler.inv_temp)

    return _loop(advance, sampler, B, G, device, eos, pad_token_id, streamer, return_logits, return_logprobs)


@torch.inference_mode()
def generate_recompute(model: nn.Module, tokens, max_new_tokens: int = 64, *, temperature: float = 0.0,
                       seed: int | None = None, eos_token_id: int | None = 1, pad_token_id: int = 0,
                       return_logits: bool = False, return_logprobs: bool = False,
                       streamer: Streamer | None = None):
    """Upstream's run.py loop, the reference: the model's forward on a PAD-filled buffer (B, P + G) re-run for
    every new token, the logits read at the current position. Same contract and results as `generate` (no
    kv_window: run.py has none).

    The mask is upstream's causal one; for left-padded rows it is (causal ∧ valid) ∨ diagonal, the cached
    path's, so pad keys stay unseen (for unpadded prompts the two are the same mask). The positions after the
    current one hold pads that the causal mask hides, as in run.py."""
    prompts, valid, _, sampler, eos = _prepare(model, tokens, max_new_tokens, 0, None, temperature, seed,
                                               eos_token_id, pad_token_id)
    B, P = prompts.shape
    G, device = int(max_new_tokens), model.device
    M = P + G
    buf = F.pad(prompts, (0, G), value=pad_token_id)  # (B, M)
    causal = make_causal_mask(M, device)  # (1, 1, M, M)
    eye = torch.eye(M, dtype=torch.bool, device=device)[None, None]  # (1, 1, M, M)
    mask = causal if bool(valid.all()) else (causal & valid[:, None, None, :]) | eye  # (B|1, 1, M, M)
    eos_t, pad_t = (torch.tensor(i, device=device) for i in (eos, pad_token_id))

    def advance(t: int, out: Tensor, done: Tensor, noise: Tensor | None):
        if t:
            buf[:, P + t - 1] = out[:, t - 1]
        logits = model(buf, mask)[:, P - 1 + t]  # (B, V) float32
        return (logits, *pick(logits, done, eos_t, pad_t, noise, sampler.inv_temp))

    return _loop(advance, sampler, B, G, device, eos, pad_token_id, streamer, return_logits, return_logprobs)
