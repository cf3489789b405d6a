"""What `needle-twin generate` does for Needle v1: encode the query, decode greedily, stream to stdout."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from convert.errors import GenerationError
from convert.generation import parse_token_ids
from convert.v1.tokenizer import build_encoder_input, check_tools_json, decode_tokens, load_tokenizer
from parity_tests.adapter import GenerateRequest
from parity_tests.v1.runs import generate_from_checkpoint

MAX_NEW_TOKENS = 64  # upstream's generate default


def generate(checkpoint, request: GenerateRequest, options: Mapping[str, Any]) -> None:
    """options: `suppress` (ids as typed) and `max_enc_len`, each None when not given."""
    tok = None if request.tokenizer is None else load_tokenizer(request.tokenizer)
    if tok is not None and tok.get_piece_size() > checkpoint.config.vocab_size:
        raise GenerationError(f"{request.tokenizer} has {tok.get_piece_size()} pieces but the model's vocabulary has "
                              f"{checkpoint.config.vocab_size}; use the tokenizer this model was trained with")
    if request.query is not None:
        src_ids = build_encoder_input(tok, request.query, check_tools_json(request.tools or "[]"),
                                      max_len=options["max_enc_len"])
    else:
        src_ids = parse_token_ids(request.tokens)
    suppress_ids = parse_token_ids(options["suppress"]) if options["suppress"] else None

    generated: list[int] = []
    shown = ""

    def stream(token: int) -> None:
        nonlocal shown
        generated.append(token)
        if tok is None:
            sys.stdout.write(f"{token} ")
        else:
            text = decode_tokens(tok, generated)
            # Print only what is new: SentencePiece joins pieces, so a piece decoded alone can lose its space.
            sys.stdout.write(text[len(shown):] if text.startswith(shown) else "\n" + text)
            shown = text
        sys.stdout.flush()

    start = time.perf_counter()
    ids = generate_from_checkpoint(checkpoint, src_ids, backend=request.backend, dtype=request.dtype,
                                   max_new_tokens=request.max_new_tokens or MAX_NEW_TOKENS,
                                   suppress_tokens=suppress_ids, streamer=stream, compile=request.compile)
    seconds = time.perf_counter() - start
    sys.stdout.write("\n")
    if tok is not None:
        print("ids: " + " ".join(map(str, ids)))
    sys.stdout.flush()
    note = "; includes jit compilation" if request.backend == "flax" or request.compile else ""
    print(f"{len(ids) - 1} tokens in {seconds:.2f}s ({request.backend}, {request.dtype or checkpoint.config.dtype}, "
          f"{len(src_ids)} encoder tokens{note})", file=sys.stderr)
