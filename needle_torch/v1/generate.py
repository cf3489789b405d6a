"""Greedy cached generation for the torch twin (`SimpleAttentionNetwork.generate` calls this).

The encoder runs once, each decoder layer's cross-attention K/V are projected once per
request into `DecoderCache`, and self-attention K/V go into preallocated float32 buffers
(upstream's cached path), so a step costs one token's worth of decoder work. With
compile=True each step (and its greedy pick) is one fused torch.compile graph.

Contract (shared with `needle_flax.generate`): tokens (B, 1 + steps) start with EOS;
each row stops at its first EOS (kept) and holds `pad_token_id` after it; the loop ends
when every row has stopped or after `max_new_tokens` steps; `suppress_tokens` are never
chosen. Shapes: B batch, S source length, L cache length (= max_new_tokens), V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from convert.generation import check_generate_args
from needle_torch.fast.kernels import CompiledStep
from needle_torch.fast.seam import fast_paths
from needle_torch.layers import make_causal_mask, make_padding_mask

Streamer = Callable[[Tensor], None]  # called with the (B,) int64 CPU tokens of each step, in order


def pick(logits: Tensor, done: Tensor, suppress: Tensor | None, eos: int | Tensor, pad: int | Tensor,
         ) -> tuple[Tensor, Tensor]:
    """Greedy choice from float32 logits (B, V): suppressed ids (bool (V,) or None) never win, finished rows pad.

    eos, pad: ints or 0-d int64 tensors (graph inputs under torch.compile)."""
    if suppress is not None:
        logits = logits.masked_fill(suppress, float("-inf"))
    nxt = logits.argmax(dim=-1)  # (B,), first index on ties like jnp.argmax
    nxt = torch.where(done, pad, nxt)
    return nxt, done | (nxt == eos)


Advance = Callable[[Tensor, int, Tensor], tuple[Tensor, Tensor, Tensor]]


def _greedy_loop(advance: Advance, B: int, L: int, device: torch.device, eos: int, pad: int,
                 streamer: Streamer | None, return_logits: bool):
    """Run up to L greedy steps; advance(tokens (B, 1+L), t, done) gives (logits (B, V), next (B,), done (B,))
    for position t + 1: pick() applied to that position's logits."""
    out = torch.full((B, L + 1), pad, dtype=torch.long, device=device)  # (B, 1+L)
    out[:, 0] = eos
    done = torch.zeros(B, dtype=torch.bool, device=device)
    step_logits = []
    steps = 0
    while steps < L:
        logits, nxt, done = advance(out, steps, done)
        out[:, steps + 1] = nxt
        steps += 1
        if return_logits:
            step_logits.append(logits)
        if streamer is not None:
            streamer(nxt.cpu())
        if bool(done.all()):  # one host sync per step; the streamer needs the tokens on the host anyway
            break
    tokens = out[:, : 1 + steps]
    return (tokens, torch.stack(step_logits, dim=1)) if return_logits else tokens


def _prepare(model: nn.Module, src, src_mask, max_new_tokens: int, eos_token_id: int,
             pad_token_id: int, suppress_tokens: Iterable[int] | None,
             ) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor]:
    """Checked inputs on the model's device: (src, src_mask, suppress bool (V,) or None, encoder_out).

    The arguments are checked as given, before any conversion (an id past int64 is out of vocabulary, not an
    overflow). src_mask None means the padding mask of src, as upstream's generate builds it. The encoder runs
    without dropout whatever the model's mode, as Flax's generate."""
    suppress = check_generate_args(model.config, src, src_mask, max_new_tokens, eos_token_id, pad_token_id,
                                   suppress_tokens)
    src = torch.as_tensor(src, device=model.device)
    src_mask = make_padding_mask(src, pad_token_id) if src_mask is None else torch.as_tensor(src_mask,
                                                                                            device=model.device)
    suppress = None if suppress is None else torch.from_numpy(suppress).to(model.device)
    if src_mask is not None and bool(src_mask.all()):
        src_mask = None  # nothing is masked: skip building an additive mask in every layer at every step
    return src, src_mask, suppress, model.encode(src, src_mask, deterministic=True)[0]  # encoder_out (B, S, D)


def _step_and_pick(model: nn.Module, tokens: Tensor, cache, pos: int | Tensor, cross_mask: Tensor | None,
                   done: Tensor, suppress: Tensor | None, eos: Tensor, pad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One decode step and its greedy choice, as one graph for torch.compile: (logits (B, V), next (B,), done)."""
    logits = model.decode_step(tokens, cache, pos, cross_mask=cross_mask)[:, 0]  # (B, V)
    return (logits, *pick(logits, done, suppress, eos, pad))


@torch.inference_mode()
def generate(model: nn.Module, src: Tensor, src_mask: Tensor | None = None, max_new_tokens: int = 64,
             eos_token_id: int = 1, suppress_tokens: Iterable[int] | None = None, pad_token_id: int = 0, *,
             streamer: Streamer | None = None, return_logits: bool = False, compile: bool = False, fast: bool = True):
    """Greedy cached generation from EOS; LongTensor (B, 1 + steps), or (tokens, float32 logits (B, steps, V)).

    src: (B, S) token ids, right-padded with pad_token_id; src_mask: bool (B, 1, 1, S) encoder/cross mask (None: the
    padding mask of src, as upstream's generate builds it; an explicit mask wins). streamer: called with each step's
    (B,) tokens as they are produced. return_logits: also return the logits each step chose from (before
    suppression). Runs in the model's dtype and on its device, never with dropout (the mode is left as it is).
    compile: run each decoder step and its greedy choice as one torch.compile graph with fixed shapes (attends over
    the whole cache under a mask). On CPU at batch <= 4 the step's products are written as reductions
    (needle_torch.fast.kernels.REDUCE_MAX_ROWS) that inductor fuses into a few passes reading every weight once in its
    own dtype. Compiles once per (batch, source length, max_new_tokens, dtype, mask or not, suppress or not);
    EOS/pad ids and the suppressed set are tensor inputs, so new values reuse the graph (inductor's disk cache
    also keeps it across processes). Past dynamo's recompile limit a request runs eagerly with a
    needle_torch.fast.kernels.CompileFallbackWarning. Guards are checked on a request's first step only: later steps
    run under torch.compiler.set_stance(skip_guard_eval_unsafe), which is process-wide, so compiled generation is
    not for concurrent threads. float32 logits stay within 1e-6 of eager; in bfloat16 inductor keeps some
    intermediates in float32, as XLA's jit does, so logits move by up to ~1e-2 relative (2e-3 at the published size,
    7e-3 on the fixtures, same tokens).
    fast: the speed forms of needle_torch.fast (reduced and packed products, the CPU's bf16 path); False runs the
    plain modules as written, eagerly or under a plain torch.compile: the baseline the fast forms are measured
    against.
    """
    with fast_paths(model, fast):
        return _generate(model, src, src_mask, max_new_tokens, eos_token_id, suppress_tokens, pad_token_id,
                         streamer, return_logits, compile)


def _generate(model, src, src_mask, max_new_tokens, eos_token_id, suppress_tokens, pad_token_id, streamer,
              return_logits, compile):
    """generate's body, run inside fast_paths(model, fast)."""
    src, src_mask, suppress, encoder_out = _prepare(model, src, src_mask, max_new_tokens, eos_token_id,
                                                    pad_token_id, suppress_tokens)
    L = int(max_new_tokens)
    cache = model.new_cache(encoder_out, L)  # cross K/V projected here, once
    # 0-d tensors: the ids are graph inputs (as Flax's int32 scalars), not constants compiled into a graph.
    eos, pad = (torch.tensor(i, device=model.device) for i in (eos_token_id, pad_token_id))
    # compiled: 0-d tensor positions, one graph for every step; eager: int positions, the filled prefix only.
    step = CompiledStep(_step_and_pick) if compile else _step_and_pick
    positions = torch.arange(L, device=model.device) if compile else range(L)

    def advance(out: Tensor, t: int, done: Tensor):
        return step(model, out[:, t : t + 1], cache, positions[t], src_mask, done, suppress, eos, pad)

    return _greedy_loop(advance, src.shape[0], L, model.device, eos_token_id, pad_token_id, streamer,
                        return_logits)


@torch.inference_mode()
def generate_recompute(model: nn.Module, src: Tensor, src_mask: Tensor | None = None,
                       max_new_tokens: int = 64, eos_token_id: int = 1, suppress_tokens: Iterable[int] | None = None,
                       pad_token_id: int = 0, *, streamer: Streamer | None = None, return_logits: bool = False):
    """Upstream's loop in torch (the whole (B, 1+L) buffer re-decoded every step, causal mask only): the reference."""
    src, src_mask, suppress, encoder_out = _prepare(model, src, src_mask, max_new_tokens, eos_token_id,
                                                    pad_token_id, suppress_tokens)
    L = int(max_new_tokens)
    causal = make_causal_mask(L + 1, model.device)  # (1, 1, 1+L, 1+L)

    def advance(out: Tensor, t: int, done: Tensor):
        logits = model.decode(out, encoder_out, causal, src_mask, deterministic=True)[:, t]  # (B, V)
        return (logits, *pick(logits, done, suppress, eos_token_id, pad_token_id))

    return _greedy_loop(advance, src.shape[0], L, model.device, eos_token_id, pad_token_id, streamer,
                        return_logits)
