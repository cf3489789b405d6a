"""SentencePiece tokenizers, shared by every family: load a `.model` file and decode ids to text.

sentencepiece is an optional dependency (`needle-twin[tokenizer]`), imported only when a tokenizer loads.
What a family builds from the ids (v1's encoder input, Needle 2's chat prompt) lives in its own folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from convert.errors import TokenizerError

SHARED_SPECIALS = 6  # ids 0..5 (PAD, EOS, BOS, UNK, <tool_call>, <tools>) sit alike in every Needle tokenizer


def load_tokenizer(path: str | os.PathLike):
    """A `sentencepiece.SentencePieceProcessor` for the `.model` file at `path`."""
    try:
        import sentencepiece as spm
    except ImportError:
        raise TokenizerError(
            "reading a tokenizer needs the sentencepiece package; install it with "
            "`pip install 'needle-twin[tokenizer]'` or pass token ids with --tokens"
        ) from None
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: no such tokenizer file; give the SentencePiece .model file")
    try:
        tokenizer = spm.SentencePieceProcessor(model_file=path)
    except (RuntimeError, OSError) as e:
        raise TokenizerError(f"{path}: not a readable SentencePiece model ({e}); give the tokenizer's .model file") \
            from None
    if tokenizer.get_piece_size() < SHARED_SPECIALS:
        raise TokenizerError(f"{path}: has {tokenizer.get_piece_size()} pieces, too few for Needle's special ids "
                             f"0..{SHARED_SPECIALS - 1} (PAD, EOS, BOS, UNK, <tool_call>, <tools>); "
                             "is it a Needle tokenizer?")
    return tokenizer


def decode_tokens(tokenizer: Any, ids: Iterable[int]) -> str:
    """Text for token ids; control ids (PAD, EOS, BOS) decode to nothing, as in SentencePiece."""
    ids = [int(i) for i in ids]
    size = tokenizer.get_piece_size()
    bad = sorted({i for i in ids if not 0 <= i < size})
    if bad:
        raise TokenizerError(f"token ids {bad[:5]} are outside the tokenizer's {size} pieces; "
                             "is this the tokenizer the model was trained with?")
    return tokenizer.decode(ids)
