"""What `needle-twin generate` and `needle-twin embed` do for Needle 3, framework-free: build the prompt, drive a
twin's runner (`needle_{torch,flax}.v3.runner.Runner`, handed in by the CLI), print the results.

A `.cact` runs as the deployment it was built for: its dequantised weights under upstream's deploy numerics
(`quant=True`: A8 activations and q, the KV cache at the header's kv_bits) and its header's kv_window.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from convert.errors import GenerationError, TokenizerError
from convert.fields import DTYPES
from convert.generation import EmbedRequest, parse_token_ids
from convert.v3 import chat
from convert.v3.config import EOS_ID, PAD_ID
from convert.v3.embedding import cosine_similarities, prompt_scores

MAX_NEW_TOKENS = 256  # upstream's run.generate default (the buffer is capped at max_seq_len)
SCORE_HEADS = ("confidence_head", "router_head")  # what a prompt's scores read


def deployed(checkpoint) -> bool:
    """A `.cact` runs with the deploy numerics it was built for."""
    return checkpoint.format.startswith("cact")


def _compute_config(checkpoint, backend: str, dtype: str | None, compile: bool = False):
    if backend not in ("torch", "flax"):
        raise GenerationError(f"--backend {backend!r} is unknown; use torch or flax")
    if compile:
        raise GenerationError("--compile does not apply to Needle 3 decoding; drop it")
    dtype = dtype or checkpoint.config.dtype
    if dtype not in DTYPES:
        raise GenerationError(f"--dtype {dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    return checkpoint.config.replace(dtype=dtype)


def _json_arg(value: str, flag: str) -> Any:
    """A JSON value given inline, or the path of a .json file holding one."""
    if value.lstrip().startswith(("[", "{")):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise TokenizerError(f"{flag} is not valid JSON ({e.msg} at column {e.colno}); check the quoting") from None
    return chat.load_tools(value)


def prompt_of(request, options: Mapping[str, Any], tokenizer: Any, max_len: int | None) -> list[int]:
    """The prompt ids: --tokens as given, or --query (and --tools, --system, --context, --extract, --schema)
    rendered by convert.v3.chat.render_prompt and encoded with BOS."""
    rendered = {"tools": request.tools, "system": options["system"], "context": options["context"],
                "extract": options["extract"], "schema": options["schema"]}
    if request.query is None:
        given = [f"--{k}" for k, v in rendered.items() if v is not None]
        if given:
            raise GenerationError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} rendered into a --query "
                                  "prompt; with --tokens give the whole prompt as ids")
        return parse_token_ids(request.tokens)
    tools = None if request.tools is None else _json_arg(request.tools, "--tools")
    schema = None if options["schema"] is None else _json_arg(options["schema"], "--schema")
    text = chat.render_prompt(request.query, tools, options["system"], options["context"], options["extract"],
                              schema)
    return chat.prompt_ids(tokenizer, text, max_len)


def generate(checkpoint, request, options: Mapping[str, Any], runner: Callable[[Any, Any], Any]) -> None:
    """Decode one prompt, streaming text (ids without --tokenizer); then the ids, the tool call, and the prompt's
    confidence and router scores. runner(params, config): a twin's Runner for the checkpoint."""
    config = _compute_config(checkpoint, request.backend, request.dtype, request.compile)
    temperature, seed, kv_window = options["temperature"] or 0.0, options["seed"], options["kv_window"]
    if seed is not None and not temperature:
        raise GenerationError("--seed draws samples, but --temperature is 0 (greedy); give --temperature T > 0")
    if request.query is not None and request.tokenizer is None:
        raise GenerationError("--query needs --tokenizer PATH (the SentencePiece .model) to become token ids")
    tok = None if request.tokenizer is None else chat.load_chat_tokenizer(request.tokenizer,
                                                                          vocab_size=config.vocab_size)
    prompt = prompt_of(request, options, tok, None)  # a prompt too long is refused below, as upstream does
    bad = sorted({t for t in prompt if not 0 <= t < config.vocab_size})
    if bad:
        raise GenerationError(f"--tokens has ids {bad[:5]} outside the model's vocabulary [0, {config.vocab_size}); "
                              "is the tokenizer the one this model was trained with?")
    room = config.max_seq_len - len(prompt)
    if room < 1:
        raise GenerationError(f"the prompt has {len(prompt)} ids, the model's max_seq_len is {config.max_seq_len}: "
                              "no room for a new token; shorten the prompt")
    sink = None
    if options["sink_tools"]:
        end = chat.MARKER_IDS[chat.TOOLS_END]
        if end not in prompt:
            raise GenerationError(f"--sink-tools: the prompt has no </tools> (id {end}) to pin up to; render it "
                                  "with --query (and --tools), or drop --sink-tools")
        sink = np.asarray([[i <= prompt.index(end) for i in range(len(prompt))]])
    steps = min(request.max_new_tokens or MAX_NEW_TOKENS, room)
    model = runner(checkpoint.params, config)

    stream = chat.TextStream(tok) if tok is not None else None
    stopped = False

    def emit(step) -> None:
        nonlocal stopped
        token = int(np.asarray(step)[0])
        if not stopped:
            sys.stdout.write(stream.feed(token) if stream is not None else f"{token} ")
            sys.stdout.flush()
        stopped = stopped or token == EOS_ID

    start = time.perf_counter()
    out = model.generate(np.asarray([prompt]), steps, streamer=emit, layers=options["layers"], kv_window=kv_window,
                         sink=sink, quant=deployed(checkpoint), temperature=temperature, seed=seed,
                         eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    seconds = time.perf_counter() - start
    ids = [int(t) for t in out[0]]
    ids = ids[:ids.index(EOS_ID) + 1] if EOS_ID in ids else ids
    if stream is not None:
        sys.stdout.write(stream.finish())
    sys.stdout.write("\n")
    print("ids: " + " ".join(map(str, ids)))
    if tok is not None:
        found = chat.extract_tool_call(stream.text)
        if found.ok:
            print("tool call: " + json.dumps([{"name": c.name, "arguments": c.arguments} for c in found.calls],
                                             ensure_ascii=False))
        else:
            sys.stdout.flush()
            print(f"no tool call: {found.reason}", file=sys.stderr)
    missing = [h for h in SCORE_HEADS if h not in checkpoint.params]
    if missing:
        print(f"scores: none (the checkpoint has no {' or '.join(missing)})")
    else:
        row = prompt_scores(*model.scores(np.asarray([prompt]), deployed(checkpoint)))[0]
        print(f"confidence: {row['confidence']:.6g}")
        print("router: " + ", ".join(f"{k} {v:.6g}" for k, v in row["router"].items()))
    sys.stdout.flush()
    how = ", deploy numerics of the .cact" if deployed(checkpoint) else ""
    rung = f", rung {options['layers']}" if options["layers"] else ""
    note = "; includes jit compilation" if request.backend == "flax" else ""
    print(f"{len(ids)} tokens in {seconds:.2f}s ({request.backend}, {config.dtype}{how}{rung}, {len(prompt)} prompt "
          f"tokens{note})", file=sys.stderr)


def embed(checkpoint, request: EmbedRequest, runner: Callable[[Any, Any], Any]) -> None:
    """Print each text's unit vector (its first values; all of them with --json) and their cosine similarities; a
    .cact's with its deploy numerics."""
    if "embedding_head" not in checkpoint.params:
        raise GenerationError(f"{checkpoint.path} has no embedding_head; give a checkpoint with the embedding head")
    config = _compute_config(checkpoint, request.backend, request.dtype)
    tok = chat.load_chat_tokenizer(request.tokenizer, vocab_size=config.vocab_size)
    vectors = runner(checkpoint.params, config).embed(tok, list(request.texts), deployed(checkpoint))
    sims = cosine_similarities(vectors)
    if request.as_json:
        print(json.dumps({"texts": list(request.texts), "dim": int(vectors.shape[1]), "dtype": config.dtype,
                          "vectors": vectors.astype(float).tolist(), "similarities": sims.tolist()},
                         ensure_ascii=False))
        return
    print(f"{len(request.texts)} vectors of {vectors.shape[1]} ({request.backend}, {config.dtype})")
    for i, (text, v) in enumerate(zip(request.texts, vectors, strict=True)):
        print(f"[{i}] {json.dumps(text, ensure_ascii=False)}: " + " ".join(f"{x:+.4f}" for x in v[:6]) + " …")
    print("cosine similarities:")
    print("     " + " ".join(f"{f'[{j}]':>7}" for j in range(len(sims))))
    for i, row in enumerate(sims):
        print(f"{f'[{i}]':>4} " + " ".join(f"{x:7.4f}" for x in row))


__all__ = ["MAX_NEW_TOKENS", "deployed", "embed", "generate", "prompt_of"]
