"""Needle 2 parity inputs: seeded random batches, token files, or chat prompts through a tokenizer."""

from __future__ import annotations

from convert.v2 import chat
from convert.v2.config import BOS_ID, FIRST_PLAIN_ID
from parity_tests.inputs import DecoderInputs

INPUTS = DecoderInputs(BOS_ID, FIRST_PLAIN_ID, chat)
random_batch, load_token_file, text_batch = INPUTS.random_batch, INPUTS.load_token_file, INPUTS.text_batch
