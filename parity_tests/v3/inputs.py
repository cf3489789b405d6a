"""Needle 3 parity inputs: seeded random batches, token files, or chat prompts through a tokenizer."""

from __future__ import annotations

from convert.v3 import chat
from convert.v3.chat import MARKER_IDS
from convert.v3.config import BOS_ID
from parity_tests.inputs import DecoderInputs

FIRST_PLAIN_ID = max(MARKER_IDS.values()) + 1  # after PAD, EOS, BOS, UNK and the fixed chat markers
INPUTS = DecoderInputs(BOS_ID, FIRST_PLAIN_ID, chat)
random_batch, load_token_file, text_batch = INPUTS.random_batch, INPUTS.load_token_file, INPUTS.text_batch
