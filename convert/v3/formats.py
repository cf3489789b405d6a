"""The files Needle 3 owns besides upstream's checkpoint, declared for the io front door: the `.cact` build.

Reading a `.cact` gives the dequantised Flax tree (lossy: CQ tensors are reconstructions, the rest was rounded
to fp16, the embedding head's log_temp and bias are not in the file and come back as upstream's initial values);
writing one quantises as upstream's exporter does.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np

from convert.family import FileFormat
from convert.source import Source, source_from_tree
from convert.trees import flatten_tree, unflatten_tree
from convert.v3 import cact
from convert.v3.config import TransformerConfig

CACT = "cact-v3"


def is_cact(head: bytes) -> bool:
    """A Needle 3 `.cact` starts with its tag (a Needle 2 one is Needle 2's format to read and name)."""
    return len(head) >= 4 and struct.unpack_from("<I", head)[0] == cact.TAG


def read_cact(path: Path) -> Source:
    """The tree a `.cact` holds, with the config its header gives; metadata 'lossy' says what is not the original."""
    back = cact.to_params(path)
    flat = flatten_tree(back.params)
    notes = list(back.notes)
    if "embedding_head/probes" in flat:  # not exported: upstream's initial values, so the head is complete
        flat["embedding_head/log_temp"] = np.asarray(cact.LOG_TEMP_INIT, np.float32)
        flat["embedding_head/bias"] = np.asarray(cact.EMBEDDING_BIAS_INIT, np.float32)
        notes.append("embedding_head/log_temp = ln(10) and embedding_head/bias = -10 are upstream's initial values")
    source = source_from_tree(unflatten_tree(flat), path)
    source.format, source.family = CACT, "v3"
    source.config_dict, source.config_origin = back.config.to_dict(), f"{path} (header)"
    source.metadata = {"lossy": "; ".join(notes)}
    return source


def write_cact(params: Any, config: TransformerConfig, path: Path, tokenizer: str | Path | None = None) -> None:
    """Upstream's build: W4, group 128, the budget kv window. The widths beyond upstream's own writer (1, 2, 3,
    1.58) are `convert.v3.cact.write_cact(..., bits=...)`; the CLI's --bits stays Needle 2's (bits maps)."""
    cact.write_cact(params, config, path, tokenizer=tokenizer)


FORMATS = (FileFormat(
    name=CACT, family="v3", extensions=(".cact",), sniff=is_cact, read=read_cact, write=write_cact,
    options=("tokenizer",), describe=cact.describe,
    lossy="a .cact holds quantised weights: CQ tensors come back as reconstructions, the rest rounded to fp16, and "
          "the embedding head's log_temp and bias are not in it",
),)
