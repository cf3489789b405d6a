"""torch.save'd state_dicts (.pt/.bin), read with torch.load(weights_only=True): tensors and plain data only."""

from __future__ import annotations

import io
import pickle
import pickletools
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

from convert.errors import CheckpointError, one_line
from convert.formats.common import plain_config
from convert.rules import TORCH
from convert.safe_pickle import BoundedReader
from convert.source import Source, checkpoint_size, file_sha256
from convert.tensors import TensorRef
from convert.trees import as_numpy

FORMAT = "torch-pt"
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default container since torch 1.6
_LEGACY_PICKLES = 5  # a legacy (non-zip) torch.save file: magic, protocol, sys_info, object, storage keys; then data
_STATE_KEYS = ("state_dict", "model_state_dict", "model")  # where training scripts commonly nest the weights


def read(path: Path) -> Source:
    checkpoint_size(path)
    try:
        import torch
    except ImportError:
        raise CheckpointError(f"{path} is a torch file; reading it needs torch (pip install 'needle-twin[torch]')") \
            from None
    zipped = _is_zip(path)
    if zipped:
        _refuse_zip_bomb(path)
    try:
        with warnings.catch_warnings():  # its protocol 4+ notice would break our one-line error on stderr
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            # weights_only: torch's own allowlist unpickler, so a hostile .pt cannot run code.
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, OSError, EOFError... for bad files
        raise _load_error(path, e) from None
    state, config = _split(obj, path)
    tensors = {}
    for name, value in state.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(f"{path}: entry {name!r} is a {type(value).__name__}, expected a tensor")
        tensors[name] = TensorRef.of(as_numpy(value))
    return Source(path, FORMAT, TORCH, tensors, config, f"{path} ('config')", {}, lambda: file_sha256(path))


def _refuse_zip_bomb(path: Path) -> None:
    """torch.load inflates a compressed member whole; torch.save never compresses, so a compressed member that
    claims more than _MAX_PICKLE bytes is refused before torch sees it (measured: +600 MB for a 306 KB file)."""
    try:
        with zipfile.ZipFile(path) as archive:  # reads the central directory only
            big = [i for i in archive.infolist() if i.compress_type != zipfile.ZIP_STORED and i.file_size > _MAX_PICKLE]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error):
        return  # damaged: torch.load fails on it and _load_error says how
    if big:
        member = big[0]
        raise CheckpointError(f"{path}: refused: {member.filename} is compressed and would inflate to "
                              f"{member.file_size:,} bytes from {member.compress_size:,} (torch.save never "
                              "compresses); get the checkpoint from a trusted source or re-save it with torch.save")


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _ZIP_MAGIC


def _load_error(path: Path, e: Exception) -> CheckpointError:
    """Our one-line error for a failed torch.load: a global seen in a whole pickle, else damage, else torch's reason."""
    seen, damage = _survey(path, e)
    named = _forbidden_global(str(e)) if isinstance(e, pickle.UnpicklingError) else None
    # A code-running global in a pickle that decodes whole is proof enough; torch names none for protocol 4+ pickles.
    hostile = sorted(name for name in seen if _runs_code(name))
    if hostile or named in seen:  # only a whole pickle's global is real: one cut mid-name fakes "torch._u"
        return _refused(path, hostile[0] if hostile else named)
    if damage:
        return CheckpointError(f"{path}: truncated or damaged torch checkpoint: {damage}; re-download the file or "
                               "re-save it with torch.save")
    if named:  # the file is whole, yet no GLOBAL spells the name (torch's "reduce for unrecognized function ...")
        return _refused(path, named)
    if isinstance(e, pickle.UnpicklingError):
        detail = _torch_detail(str(e))
        return CheckpointError(f"{path}: refused: its pickle holds objects or opcodes torch's weights-only loader does "
                               f"not read{f' ({detail})' if detail else ''}; {_RESAVE}")
    return CheckpointError(f"{path}: torch.load cannot read this file ({type(e).__name__}: {_torch_detail(str(e))}); "
                           "re-download the file or re-save it with torch.save")


_RESAVE = "re-save only the state_dict (torch.save(model.state_dict(), path)) or convert it to .safetensors"


def _refused(path: Path, name: str) -> CheckpointError:
    """Refusal naming the global: hostile wording only for globals known to run code, not for argparse/numpy objects."""
    if _runs_code(name):
        return CheckpointError(f"{path}: refused: its pickle references the forbidden global {name}, which would run "
                               "code if the file were loaded unsafely; get the weights from a trusted source, ideally "
                               "as .safetensors")
    return CheckpointError(f"{path}: refused: its pickle holds objects torch's weights-only loader does not build "
                           f"(global {name}); {_RESAVE}")


# Globals that run code or commands when called: a small explicit list (whole modules, or module.name).
_RUNS_CODE = frozenset({
    "subprocess", "runpy", "importlib", "shutil", "socket", "webbrowser", "ctypes", "pty",
    *(f"{module}.{name}" for module in ("pickle", "_pickle", "marshal") for name in ("load", "loads")),
    *(f"builtins.{name}" for name in ("eval", "exec", "compile", "__import__", "getattr", "setattr", "open",
                                      "breakpoint")),
})
_OS_RUNS_CODE = re.compile(r"(os|posix|nt)\.(system|popen|exec\w*|spawn\w*)$")


def _runs_code(name: str) -> bool:
    return name in _RUNS_CODE or name.split(".")[0] in _RUNS_CODE or bool(_OS_RUNS_CODE.match(name))


def _survey(path: Path, e: Exception) -> tuple[set[str], str | None]:
    """(globals named by the file's pickles that decode whole, what is cut off or broken or None); builds nothing."""
    with open(path, "rb") as f:
        head = f.read(4)
    if head == _ZIP_MAGIC or (len(head) < 4 and _ZIP_MAGIC.startswith(head)):
        return _zip_survey(path)
    return _legacy_survey(path, head, e)


def _zip_survey(path: Path) -> tuple[set[str], str | None]:
    size = path.stat().st_size
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        # A cut-off zip loses its central directory, which sits at the very end of the file.
        return set(), f"the zip archive is incomplete ({size} bytes, its central directory at the end is missing)"
    except (OSError, ValueError, EOFError, struct.error) as e:  # zipfile's other complaints about mangled records
        return set(), f"the zip archive is corrupt ({type(e).__name__}: {one_line(e, 80)})"
    with archive:
        info = next((i for i in archive.infolist() if i.filename == "data.pkl" or i.filename.endswith("/data.pkl")),
                    None)
        if info is None:
            return set(), "the zip archive has no data.pkl, so torch.save did not write it"
        # torch.save stores data.pkl uncompressed and small: never inflate (a zip bomb) nor read a huge one.
        if info.compress_type != zipfile.ZIP_STORED or max(info.file_size, info.compress_size) > _MAX_PICKLE:
            return set(), None
        try:
            data = archive.read(info)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, struct.error, NotImplementedError) as e:
            return set(), f"its {info.filename} cannot be read ({one_line(e, 80)})"
    seen, broken = _scan(BoundedReader(io.BytesIO(data), len(data), max_line=_MAX_LINE))
    return (set(), f"its {info.filename} is cut short or corrupt ({broken})") if broken else (seen, None)


def _legacy_survey(path: Path, head: bytes, e: Exception) -> tuple[set[str], str | None]:
    size, seen = path.stat().st_size, set()
    with open(path, "rb") as f:
        stream = BoundedReader(f, size, max_line=_MAX_LINE)
        for i in range(_LEGACY_PICKLES):
            names, broken = _scan(stream)
            # Protocol 2+ pickles open with PROTO (0x80); protocol 0-1 ones are told by decoding the first.
            if broken and i == 0 and head[:1] != b"\x80":
                return seen, f"it is neither a zip archive nor a legacy torch pickle (starts with {head!r})"
            if broken:
                return seen, f"the legacy (non-zip) file's pickle {i + 1} of {_LEGACY_PICKLES} is cut short or " \
                             f"corrupt ({broken}; {size} bytes in all)"
            seen |= names
    # The pickles are whole: a short read past them means the raw tensor bytes are cut off.
    if isinstance(e, (EOFError, struct.error)) or "unexpected EOF" in str(e):
        return seen, f"the legacy (non-zip) file's tensor data is cut short ({size} bytes)"
    return seen, None


_MAX_PICKLE = 256 << 20  # bytes; torch.save's data.pkl holds keys and storage ids only, far below this
_MAX_LINE = 1 << 20  # bytes; a text opcode's argument (a global's name, a decimal) is never near this long
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE"})
_MEMO_OPS = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})  # store the top of the stack, push nothing
_GET_OPS = frozenset({"GET", "BINGET", "LONG_BINGET"})  # push what a memo op stored
_OLD_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg"}  # protocol 0-2 spellings, as torch reports them


def _scan(stream: BoundedReader) -> tuple[set[str], str | None]:
    """(globals the pickle at stream names, why it is incomplete or malformed or None); decodes opcodes only."""
    seen: set[str] = set()
    pushed: list[str | None] = [None, None]  # the last two pushes, for STACK_GLOBAL's module and name
    memo: dict[int, str | None] = {}  # strings stored for later GETs (a module name used twice is fetched)
    try:
        for op, arg, _ in pickletools.genops(stream):
            if op.name == "GLOBAL":
                seen.add(_global(*arg.split(" ", 1)))
            elif op.name == "STACK_GLOBAL" and None not in pushed:
                seen.add(_global(*pushed))
            if op.name in _MEMO_OPS:  # stores the top of the stack, pushes nothing
                memo[len(memo) if op.name == "MEMOIZE" else arg] = pushed[1]
            else:
                pushed = [pushed[1], memo.get(arg) if op.name in _GET_OPS else arg if op.name in _STRING_OPS
                          else None]
    # genops' complaints (truncated argument, missing STOP, unknown opcode, bad text), plus what garbage can provoke
    except (ValueError, EOFError, MemoryError, OverflowError, struct.error) as e:
        return seen, one_line(e, 80) or type(e).__name__
    return seen, None


def _global(module: str, name: str) -> str:
    return f"{_OLD_MODULES.get(module, module)}.{name}"


_GLOBAL_PATTERNS = (
    r"GLOBAL (\S+) was not an allowed global",  # "Unsupported global: GLOBAL eval was not an allowed global ..."
    r"GLOBAL (\S+) whose module \S+ is blocked",  # "Trying to load unsupported GLOBAL posix.system whose module ..."
    r"reduce for unrecognized function (.+?)(?: which belongs to|\n|$)",  # "Trying to call reduce for ..."
)


def _forbidden_global(text: str) -> str | None:
    """The global torch's weights-only unpickler refused, from its message (torch drops "builtins.")."""
    for pattern in _GLOBAL_PATTERNS:
        m = re.search(pattern, text, flags=re.MULTILINE)
        if m:
            name = m.group(1)
            return name if "." in name or name.startswith("<") else f"builtins.{name}"
    return None


def _torch_detail(text: str) -> str:
    """torch's error without its advice: it suggests weights_only=False, i.e. running the file's code."""
    parts = [p for p in re.split(r"\n\s*\n|\n\t", text) if p.strip()]
    keep = [p for p in parts if not re.search(r"weights_only|Weights only load failed|documentation|trust", p)]
    return one_line(" ".join(keep).split(" This is an internal miniz error")[0], 120)


def _split(obj: Any, path: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(state_dict, config) from a bare state_dict or {"state_dict"|"model_state_dict"|"model": ..., "config": ...}."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: holds a {type(obj).__name__}, expected a state_dict (dict of tensors)")
    for key in _STATE_KEYS:
        if isinstance(obj.get(key), dict):
            config = obj.get("config")
            return obj[key], (plain_config(config, path) if config is not None else None)
    return obj, None
