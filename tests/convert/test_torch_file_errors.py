"""Hostile, truncated and damaged torch .pt files: one line naming the problem and the fix, nothing run or written."""

from __future__ import annotations

import argparse
import builtins
import io
import pickle
import re
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import cli
from convert.errors import CheckpointError
from convert.formats import torch_format
from convert.mapping import flax_to_torch, random_flax_params
from convert.safe_pickle import BoundedReader
from tests.convert_helpers import TINY, RunsCommand, assert_refused, tiny_config_json

runner = CliRunner()

FIX = r"re-download the file or re-save it with torch\.save"
ZIP_CUT = r"truncated or damaged torch checkpoint: the zip archive is incomplete \(\d+ bytes"
LEGACY_CUT = r"truncated or damaged torch checkpoint: the legacy \(non-zip\) file's (tensor data|pickle \d of 5) is cut"
RESAVE = r"re-save only the state_dict \(torch\.save\(model\.state_dict\(\), path\)\) or convert it to \.safetensors"
UNSAFE_ADVICE = re.compile(r"weights_only|trust the source|add_safe_globals", re.IGNORECASE)  # torch's hints


class EvalsCode:
    """A payload that makes `marker` through builtins.eval if unpickled by a stock unpickler."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return builtins.eval, (f"__import__('pathlib').Path({str(self.marker)!r}).touch()",)


class ExecsCode(EvalsCode):
    """The same through builtins.exec."""

    def __reduce__(self):
        return builtins.exec, (f"__import__('pathlib').Path({str(self.marker)!r}).touch()",)


# payload class, the name our message must give (torch reports os.system by its real module, posix or nt)
PAYLOADS = {
    "os.system": (RunsCommand, r"(posix|nt|os)\.system"),
    "eval": (EvalsCode, r"builtins\.eval"),
    "exec": (ExecsCode, r"builtins\.exec"),
}


def _state() -> dict:
    return flax_to_torch(random_flax_params(TINY, seed=0), TINY)


def _save(path: Path, obj: object, legacy: bool = False) -> Path:
    torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
    return path


def _cut(path: Path, fraction: float) -> Path:
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:max(1, int(size * fraction))])
    return path


def _read_error(src: Path) -> str:
    """The library's message for src: one line, with none of torch's advice to load unsafely."""
    with pytest.raises(CheckpointError) as info:
        torch_format.read(src)
    message = str(info.value)
    assert "\n" not in message and not UNSAFE_ADVICE.search(message), message
    return message


def _cli_refuses(tmp_path: Path, src: Path, pattern: str) -> str:
    """`python -m cli convert` as a real process refuses src: one line matching pattern, none of torch's advice."""
    config = tiny_config_json(tmp_path / "tiny.json")
    return assert_refused(tmp_path, src, pattern, "out.safetensors", "--config", config, process=True,
                          never=UNSAFE_ADVICE)


# ----------------------------------------------------------------------------- controls


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_untouched_file_converts(tmp_path, legacy):
    """The files the tests below cut are valid: the same command succeeds on them whole."""
    src = _save(tmp_path / "m.pt", _state(), legacy)
    dst = tmp_path / "out.safetensors"
    config = tiny_config_json(tmp_path / "tiny.json")
    result = runner.invoke(cli.app, ["convert", str(src), str(dst), "--config", str(config), "--quiet"])
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert dst.is_file()


@pytest.mark.parametrize("payload", PAYLOADS)
def test_payload_is_live(tmp_path, payload):
    """A stock unpickler does run each payload, so the marker checks below can fail."""
    marker = tmp_path / "marker"
    pickle.loads(pickle.dumps(PAYLOADS[payload][0](marker)))
    assert marker.exists()


# ----------------------------------------------------------------------------- hostile files


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_file_names_the_forbidden_global(tmp_path, payload, legacy):
    make, name = PAYLOADS[payload]
    marker = tmp_path / "marker"
    src = _save(tmp_path / "evil.pt", {**_state(), "x": make(marker)}, legacy)
    message = _read_error(src)
    assert re.search(rf"refused: its pickle references the forbidden global {name}, which would run code if the "
                     r"file were loaded unsafely; get the weights from a trusted source", message), message
    assert not marker.exists()


@pytest.mark.parametrize(("payload", "legacy"), [("os.system", False), ("eval", True), ("exec", False)])
def test_hostile_file_through_cli(tmp_path, payload, legacy):
    make, name = PAYLOADS[payload]
    marker = tmp_path / "marker"
    src = _save(tmp_path / "evil.pt", {**_state(), "x": make(marker)}, legacy)
    _cli_refuses(tmp_path, src, rf"forbidden global {name}, which would run code")
    assert not marker.exists()


def test_unnamed_refusal_falls_back_to_a_generic_line(tmp_path):
    """A pickle torch refuses without naming a global (opcode EXT1 here) still gets our line, not torch's advice."""
    src = _zip_with_pickle(tmp_path / "odd.pt", b"\x80\x02\x82\x01.", zipfile.ZIP_STORED,  # PROTO 2, EXT1 1, STOP
                           version=True)
    message = _read_error(src)
    assert re.search(rf"refused: its pickle holds objects or opcodes torch's weights-only loader does not read "
                     rf"\(Unsupported operand 130\); {RESAVE}$", message), message
    assert "forbidden global" not in message and "run code" not in message


# ----------------------------------------------------------------------------- truncated and damaged files


@pytest.mark.parametrize(("legacy", "pattern"), [(False, ZIP_CUT), (True, LEGACY_CUT)], ids=["zip", "legacy"])
def test_truncated_file(tmp_path, legacy, pattern):
    """Cut anywhere, the library says so; the CLI says so too (checked at one cut: a real process takes seconds)."""
    whole = _save(tmp_path / "whole.pt", _state(), legacy).read_bytes()
    for fraction in (0.1, 0.5, 0.99):
        src = tmp_path / f"cut-{fraction}.pt"
        src.write_bytes(whole)
        assert re.search(rf"{pattern}.*; {FIX}$", _read_error(_cut(src, fraction))), fraction
    _cli_refuses(tmp_path, src, pattern)


@pytest.mark.parametrize("size", [1, 3])
def test_zip_cut_inside_its_magic(tmp_path, size):
    src = _save(tmp_path / "m.pt", _state())
    src.write_bytes(src.read_bytes()[:size])
    assert re.search(ZIP_CUT, _read_error(src))


def test_legacy_cut_inside_a_global_is_not_called_hostile(tmp_path):
    """torch reads a GLOBAL cut mid-name as the unknown global "torch._u": we must say truncated, not forbidden."""
    src = _save(tmp_path / "m.pt", _state(), legacy=True)
    data = src.read_bytes()
    cut = data.index(b"ctorch._utils\n") + len(b"ctorch._u")  # GLOBAL opcode "c", then "module\nname\n"
    src.write_bytes(data[:cut])
    message = _read_error(src)
    assert re.search(r"legacy \(non-zip\) file's pickle 4 of 5 is cut short", message), message
    assert "forbidden" not in message


def test_zip_with_a_corrupt_pickle_member(tmp_path):
    src = _save(tmp_path / "m.pt", _state())
    data = bytearray(src.read_bytes())
    at = data.index(b"data.pkl") + 40  # inside data.pkl's stored bytes, just past its local header
    data[at:at + 8] = b"\xff" * 8
    src.write_bytes(bytes(data))
    assert re.search(rf"truncated or damaged torch checkpoint: its \S*data.pkl cannot be read \(Bad CRC-32.*{FIX}",
                     _read_error(src))


def test_neither_zip_nor_pickle(tmp_path):
    src = tmp_path / "junk.pt"
    src.write_bytes(b"hello world")
    assert re.search(r"neither a zip archive nor a legacy torch pickle \(starts with b'hell'\)", _read_error(src))


def test_zero_byte_file(tmp_path):
    src = tmp_path / "empty.pt"
    src.write_bytes(b"")
    assert re.search(r"empty file \(0 bytes\); re-", _read_error(src))
    _cli_refuses(tmp_path, src, r"empty file \(0 bytes\)")


# ----------------------------------------------------------------------------- crafted lengths, zip bombs, odd pickles

_LEGACY_MAGIC = pickle.dumps(0x1950A86A20F9469CFC6C, protocol=2)  # the first of a legacy torch.save file's pickles


@pytest.mark.parametrize("prefix", [b"", _LEGACY_MAGIC], ids=["bare", "after-magic"])
def test_crafted_length_is_damage_not_a_memory_error(tmp_path, prefix):
    """BINUNICODE8 claiming 2**40 bytes: genops would read(2**40); we report damage, through the CLI too."""
    src = tmp_path / "huge.pt"
    src.write_bytes(prefix + b"\x80\x04\x8d" + struct.pack("<Q", 2**40) + b"abc")
    assert re.search(r"is cut short or corrupt \(expected 1099511627776 bytes in a unicodestring8, but only 3 remain",
                     _read_error(src))
    if prefix:  # a bare pickle is routed to the upstream-pickle reader by the CLI
        _cli_refuses(tmp_path, src, r"truncated or damaged torch checkpoint: the legacy \(non-zip\) file's pickle 2")


class _Reads(io.BytesIO):
    """Records the largest read asked of it."""

    largest = 0

    def read(self, n=-1):
        self.largest = max(self.largest, n)
        return super().read(n)


def test_pickle_scan_never_asks_for_more_than_remains():
    data = b"\x80\x04\x8d" + struct.pack("<Q", 2**62) + b"abc"
    stream = _Reads(data)
    seen, broken = torch_format._scan(BoundedReader(stream, len(data), max_line=torch_format._MAX_LINE))
    assert broken and "unicodestring8" in broken and seen == set()
    assert stream.largest <= len(data), stream.largest


def _zip_with_pickle(path: Path, pickle_bytes: bytes, compression: int, version: bool = False) -> Path:
    """A zip whose data.pkl is stored with `compression`; torch loads it only with a version record (`version`)."""
    with zipfile.ZipFile(path, "w", compression=compression) as z:
        if version:
            z.writestr("archive/version", b"3\n")
        z.writestr("archive/data.pkl", pickle_bytes)
    return path


_PADDED_EMPTY = b"\x80\x02}q\x00." + b"\x00" * (1 << 20)  # the pickle of {}, then 1 MiB of padding it never reads


@pytest.mark.parametrize("case", ["deflated", "huge"])
def test_zip_pickle_is_not_inflated_or_read_whole(tmp_path, monkeypatch, case):
    """torch.save stores data.pkl small and uncompressed: a deflated (zip bomb) or oversized one is not read."""
    compression = zipfile.ZIP_DEFLATED if case == "deflated" else zipfile.ZIP_STORED
    src = _zip_with_pickle(tmp_path / "bomb.pt", _PADDED_EMPTY, compression)
    if case == "huge":
        monkeypatch.setattr(torch_format, "_MAX_PICKLE", 1 << 19)  # bytes; stands in for 256 MiB, below this 1 MiB
    opened = []
    real_open = zipfile.ZipFile.open
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda self, name, *a, **k: opened.append(name) or
                        real_open(self, name, *a, **k))
    message = _read_error(src)
    assert not [n for n in opened if str(getattr(n, "filename", n)).endswith("data.pkl")], opened
    assert "data.pkl" not in message and "version" in message, message  # torch's own reason, not ours


def test_zip_bomb_is_refused_before_torch_inflates_it(tmp_path, monkeypatch):
    """A deflated member claiming more than the limit never reaches torch.load (which would inflate it whole)."""
    monkeypatch.setattr(torch_format, "_MAX_PICKLE", 1 << 19)  # bytes; stands in for 256 MiB, below this 1 MiB
    # the version record is what makes torch.load go on to inflate data.pkl
    src = _zip_with_pickle(tmp_path / "bomb.pt", _PADDED_EMPTY, zipfile.ZIP_DEFLATED, version=True)
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load must not see a zip bomb"))
    message = _read_error(src)
    monkeypatch.setattr(torch, "load", real_load)
    assert re.search(r"refused: archive/data\.pkl is compressed and would inflate to 1,048,582 bytes from [\d,]+ "
                     r"\(torch.save never compresses\)", message), message
    # the same bytes stored, as torch.save writes them: not a bomb
    stored = _zip_with_pickle(tmp_path / "stored.pt", _PADDED_EMPTY, zipfile.ZIP_STORED, version=True)
    assert torch_format.read(stored).tensors == {}  # torch reads its pickle ({}) and ignores the padding


@pytest.mark.parametrize("namespace", [False, True], ids=["plain", "namespace"])
def test_legacy_protocol_1_file_is_not_called_damaged(tmp_path, namespace):
    """torch's weights-only loader cannot read protocol-1 pickles (LONG, operand 76); the file is whole, not cut."""
    obj = {"model_state_dict": _state(), "args": argparse.Namespace(lr=0.1)} if namespace else _state()
    src = tmp_path / "p1.pt"
    torch.save(obj, src, _use_new_zipfile_serialization=False, pickle_protocol=1)
    message = _read_error(src)
    assert re.search(rf"refused: its pickle holds objects or opcodes .* \(Unsupported operand 76\); {RESAVE}$",
                     message), message
    assert not re.search(r"damaged|truncated|neither|run code", message), message


TRAINING_EXTRAS = {
    "namespace": (argparse.Namespace(lr=0.1, epochs=3), r"argparse\.Namespace"),
    "np-scalar": (np.float64(0.5), r"numpy\.\S*scalar"),
    "np-array": (np.zeros(3), r"numpy\.\S*_reconstruct"),
}


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("extra", TRAINING_EXTRAS)
def test_training_checkpoint_objects_are_not_called_hostile(tmp_path, extra, legacy):
    value, name = TRAINING_EXTRAS[extra]
    src = _save(tmp_path / "ckpt.pt", {"model_state_dict": _state(), "extra": value}, legacy)
    message = _read_error(src)
    assert re.search(rf"refused: its pickle holds objects torch's weights-only loader does not build "
                     rf"\(global {name}\); {RESAVE}$", message), message
    assert not re.search(r"run code|forbidden|trusted|damaged", message), message


@pytest.mark.parametrize(("name", "runs"), [
    ("posix.system", True), ("nt.system", True), ("os.execv", True), ("subprocess.Popen", True),
    ("builtins.getattr", True), ("builtins.__import__", True), ("importlib.import_module", True),
    ("pickle.loads", True), ("runpy._run_code", True), ("ctypes.CDLL", True),
    ("argparse.Namespace", False), ("numpy.core.multiarray._reconstruct", False), ("builtins.set", False),
    ("collections.OrderedDict", False), ("os.path.join", False), ("pickle.PickleBuffer", False),
])
def test_only_known_code_runners_are_hostile(name, runs):
    assert torch_format._runs_code(name) is runs


@pytest.mark.parametrize(("layout", "protocol"), [("after-magic", 2), ("bare", 2), ("bare", 4), ("bare", 5)])
@pytest.mark.parametrize("payload", PAYLOADS)
def test_hostile_pickle_without_the_legacy_layout_is_refused(tmp_path, payload, layout, protocol):
    """Fewer pickles than torch.save writes: still refused by the global, not called cut short (torch names none
    for protocol 4+, so the global comes from our own opcode scan)."""
    make, name = PAYLOADS[payload]
    marker = tmp_path / "marker"
    src = tmp_path / "evil.bin"
    prefix = _LEGACY_MAGIC if layout == "after-magic" else b""
    src.write_bytes(prefix + pickle.dumps({"w": make(marker)}, protocol=protocol))
    message = _read_error(src)
    assert re.search(rf"refused: its pickle references the forbidden global {name}, which would run code", message), \
        message
    assert "cut short" not in message
    assert not marker.exists()


def test_hostile_pickle_through_cli(tmp_path):
    marker = tmp_path / "marker"
    src = tmp_path / "evil.bin"
    src.write_bytes(_LEGACY_MAGIC + pickle.dumps(RunsCommand(marker), protocol=2))
    _cli_refuses(tmp_path, src, r"forbidden global (posix|nt|os)\.system, which would run code")
    assert not marker.exists()
