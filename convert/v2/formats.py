"""The files Needle 2 owns besides upstream's checkpoint pickle, declared for the io front door: the `.cact` build.

Reading a `.cact` gives the dequantised Flax tree (lossy: CQ tensors are reconstructions, the rest was rounded
to fp16, the MTP head and log_temp are not in the file); writing one quantises as upstream's exporter does.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from convert import safe_pickle
from convert.errors import NeedleTwinError
from convert.family import AdapterFormat, FileFormat
from convert.source import Source, source_from_tree
from convert.v2 import cact, lora
from convert.v2.bits import check_bits, format_bits_map
from convert.v2.config import TransformerConfig

CACT = "cact"


def is_cact(head: bytes) -> bool:
    """A `.cact` header starts with its tag (an older or newer tag still counts: the reader names it)."""
    return len(head) >= 4 and struct.unpack_from("<I", head)[0] in (cact.TAG, *cact.OTHER_TAGS)


def read_cact(path: Path) -> Source:
    """The tree a `.cact` holds, with the config its header gives; metadata 'lossy' says what is not the original."""
    back = cact.to_params(path)
    source = source_from_tree(back.params, path)
    source.format, source.family = CACT, "v2"
    source.config_dict, source.config_origin = back.config.to_dict(), f"{path} (header)"
    source.metadata = {"lossy": "; ".join(back.lossy.lines())}
    return source


def write_cact(params: Any, config: TransformerConfig, path: Path, bits: str | None = None,
               tokenizer: str | Path | None = None) -> None:
    """bits: "2", "3", "4", "1.58", or a bits map such as "default=2,embedding=4,attn.q_proj=3"; None: the config's
    weight_bits, else 4 (as `needle build`)."""
    bits_map = bits if bits is not None and "=" in bits else None
    width = None if bits is None or bits_map is not None else _width(bits)
    cact.write_cact(params, config, path, bits=width, bits_map=bits_map, tokenizer=tokenizer)


def _width(bits: str) -> float | int:
    """'4' -> 4, '1.58' -> 1.58; anything else is refused naming the choices (convert.v2.bits.check_bits)."""
    try:
        value: Any = float(bits)
    except ValueError:
        value = bits  # check_bits names it
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return check_bits(value, "--bits")


def describe_cact(path: Path) -> dict[str, Any]:
    """What `needle-twin inspect` adds for a `.cact`: every lint problem, and (when the file reads) the header as
    the engine sees it, the record count, the bits map the records imply and whether a tokenizer is inside."""
    out: dict[str, Any] = {"lint": cact.lint(path)}
    try:
        f = cact.read_cact(path)
        implied = cact.implied_bits_map(f.records)
        out.update(engine_config={k: (list(v) if isinstance(v, tuple) else v) for k, v in f.info.items()
                                  if k != "codebook"},
                   records=len(f), tokenizer=f.has_tokenizer, heads=list(f.heads),
                   bits=None if implied is None else format_bits_map(*implied))
    except NeedleTwinError:
        pass  # lint has said why
    return out


FORMATS = (FileFormat(
    name=CACT, family="v2", extensions=(".cact",), sniff=is_cact, read=read_cact, write=write_cact,
    options=("bits", "tokenizer"), describe=describe_cact,
    lossy="a .cact holds quantised weights: CQ tensors come back as reconstructions, the rest rounded to fp16, "
          "and it has no MTP head or log_temp",
),)


# ----------------------------------------------------------------------------- LoRA adapters


def is_adapter(path: Path) -> bool:
    """A PEFT adapter directory (adapter_config.json), or an upstream adapter pickle (a dict with a "lora" key)."""
    path = Path(path)
    if path.is_dir():
        return (path / "adapter_config.json").is_file()
    try:
        with open(path, "rb") as f:
            if f.read(1) != b"\x80":  # a pickle of protocol 2+: upstream's pickle.dump
                return False
        obj = safe_pickle.load_file(path, lazy=True)  # large arrays stay in the file: a checkpoint costs a scan
    except safe_pickle.UnsafePickleError:
        raise  # a hostile file is named as such, whatever it claims to be
    except (OSError, NeedleTwinError):
        return False  # not ours to judge: the checkpoint readers name what is wrong with it
    return isinstance(obj, dict) and "lora" in obj


ADAPTERS = (AdapterFormat(
    name="needle2-lora", family="v2", recognise=is_adapter, read=lora.read_adapter, describe=lora.describe,
    check=lora.check_adapter, merge=lora.merged_params, write=lora.write_adapter,
),)
