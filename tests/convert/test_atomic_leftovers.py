"""What a killed writer leaves beside its output (temps, a moved-aside previous output) is cleaned by the next run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from convert import atomic
from convert.io import read_checkpoint, write_checkpoint
from convert.mapping import random_flax_params
from convert.trees import flatten_tree
from parity_tests.fixtures import FIXTURE_PKL
from tests.convert_helpers import REPO, TINY, assert_trees_bit_identical, leftovers, run_cli


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(ProcessLookupError):  # a pid reused this fast would make the test meaningless: say so
        os.kill(proc.pid, 0)
    return proc.pid


def make_file(path: Path, data: bytes = b"half-written") -> Path:
    path.write_bytes(data)
    return path


def make_dir(path: Path) -> Path:
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"half-written shard")
    return path


def assert_is_fixture(path: Path, dtype: str | None = None) -> None:
    """path holds the fixture's weights: bit-identical, or (dtype given) all of that dtype."""
    fixture = read_checkpoint(FIXTURE_PKL).params
    got = read_checkpoint(path).params
    if dtype is None:
        assert_trees_bit_identical(got, fixture)
    else:
        assert sorted(flatten_tree(got)) == sorted(flatten_tree(fixture))
        assert {str(np.asarray(a).dtype) for a in flatten_tree(got).values()} == {dtype}


# ----------------------------------------------------------------------------- library


def test_library_write_removes_dead_writers_temps_and_keeps_the_rest(tmp_path):
    dead, live = dead_pid(), os.getpid()
    dst = tmp_path / "m.safetensors"
    removed = [make_file(tmp_path / f".m.safetensors.needle-tmp-{dead}-0123abcd"),
               make_dir(tmp_path / f".m.safetensors.needle-tmp-{dead}-89abcdef")]
    kept = [make_file(tmp_path / f".m.safetensors.needle-tmp-{live}-0123abcd"),  # our own pid: a concurrent writer
            make_file(tmp_path / f".other.safetensors.needle-tmp-{dead}-0123abcd"),  # another target's
            make_file(tmp_path / f".m.safetensor.needle-tmp-{dead}-0123abcd"),  # another (prefix) target's
            make_file(tmp_path / f".m.safetensors.needle-tmp-{dead}-0123abc"),  # 7 hex digits
            make_file(tmp_path / f".m.safetensors.needle-tmp-{dead}-0123ABCD"),  # not our lowercase hex
            make_file(tmp_path / f".m.safetensors.needle-tmp-{dead}-0123abcd.bak"),  # suffix
            make_file(tmp_path / f"m.safetensors.needle-tmp-{dead}-0123abcd"),  # no leading dot
            make_file(tmp_path / f".m.safetensors.needle-tmp-x{dead}-0123abcd"),  # not a pid
            make_file(tmp_path / ".m.safetensors.needle-tmp-0-0123abcd"),  # pid 0 would probe our process group
            make_dir(tmp_path / f".m.safetensors.needle-old-{dead}")]  # no hex part
    params = random_flax_params(TINY, seed=1, dtype="float32")
    write_checkpoint(params, TINY, dst)
    assert [p for p in removed if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert_trees_bit_identical(read_checkpoint(dst).params, params)


def test_leftovers_are_cleaned_even_by_a_write_that_then_fails(tmp_path):
    dead = dead_pid()
    dst = tmp_path / "m.pkl"
    temp = make_file(tmp_path / f".m.pkl.needle-tmp-{dead}-00000000")
    with pytest.raises(RuntimeError, match="writer broke"), atomic.atomic_output(dst, force=False) as tmp:
        tmp.write_bytes(b"partial")
        raise RuntimeError("writer broke")
    assert not temp.exists() and not dst.exists() and leftovers(tmp_path) == []


def test_symlinked_leftover_is_unlinked_never_followed(tmp_path):
    dead, other_dead = dead_pid(), dead_pid()
    outside = tmp_path / "outside"
    outside.mkdir()
    precious_file = make_file(outside / "precious.bin", b"keep me")
    precious_dir = make_dir(outside / "precious_dir")
    out = tmp_path / "out"
    out.mkdir()
    links = [out / f".m.pkl.needle-tmp-{dead}-11111111", out / f".m.pkl.needle-tmp-{dead}-22222222",
             out / f".m.pkl.needle-old-{other_dead}-33333333"]  # no tmp of its pid: its swap was done
    links[0].symlink_to(precious_file)
    links[1].symlink_to(precious_dir, target_is_directory=True)
    links[2].symlink_to(precious_dir, target_is_directory=True)
    with atomic.atomic_output(out / "m.pkl", force=False) as tmp:
        tmp.write_bytes(b"new")
    assert [p for p in links if p.is_symlink() or p.exists()] == []
    assert precious_file.read_bytes() == b"keep me"
    assert (precious_dir / "model.safetensors").read_bytes() == b"half-written shard"
    assert (out / "m.pkl").read_bytes() == b"new"


def test_temp_of_a_concurrent_writer_in_this_process_is_kept(tmp_path):
    dst = tmp_path / "m.pkl"
    with atomic.atomic_output(dst, force=True) as first:
        first.write_bytes(b"first")

        def second_writer() -> None:
            with atomic.atomic_output(dst, force=True) as second:
                second.write_bytes(b"second")

        thread = threading.Thread(target=second_writer)
        thread.start()
        thread.join()
        assert first.read_bytes() == b"first"  # the second writer's cleanup saw our live pid and kept it
        assert dst.read_bytes() == b"second"
    assert dst.read_bytes() == b"first" and leftovers(tmp_path) == []


def test_pid_we_may_not_signal_counts_as_alive(tmp_path, monkeypatch):
    def kill(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")  # what another user's live process answers

    temp = make_file(tmp_path / ".m.pkl.needle-tmp-4242-0123abcd")
    monkeypatch.setattr(atomic.os, "kill", kill)
    with atomic.atomic_output(tmp_path / "m.pkl", force=False) as tmp:
        tmp.write_bytes(b"new")
    assert temp.read_bytes() == b"half-written"


def test_dead_swap_with_dst_missing_restores_the_previous_output(tmp_path):
    dead = dead_pid()
    dst = tmp_path / "hf"
    moved = make_dir(tmp_path / f".hf.needle-old-{dead}-abcdef01")
    new = make_dir(tmp_path / f".hf.needle-tmp-{dead}-abcdef02")
    with pytest.raises(atomic.OutputExistsError, match="pass --force"), \
            atomic.atomic_output(dst, force=False, directory=True):
        pytest.fail("the restored output must be protected like any existing output")
    assert (dst / "model.safetensors").read_bytes() == b"half-written shard"
    assert not moved.exists() and not new.exists() and leftovers(tmp_path) == []


def test_dead_swap_with_dst_present_deletes_the_superseded_copy(tmp_path):
    dead = dead_pid()
    dst = make_dir(tmp_path / "hf")
    (dst / "config.json").write_text("{}")
    moved = make_dir(tmp_path / f".hf.needle-old-{dead}-abcdef01")
    with atomic.atomic_output(dst, force=True, directory=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text('{"new": 1}')
    assert not moved.exists() and leftovers(tmp_path) == []
    assert (dst / "config.json").read_text() == '{"new": 1}'


def test_live_swap_is_left_alone(tmp_path):
    live = os.getpid()
    moved = make_dir(tmp_path / f".hf.needle-old-{live}-abcdef01")
    with atomic.atomic_output(tmp_path / "hf", force=False, directory=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert (moved / "model.safetensors").read_bytes() == b"half-written shard"  # neither restored nor deleted


def test_several_dead_swaps_and_no_dst_keep_every_candidate(tmp_path):
    dead = [dead_pid(), dead_pid()]
    moved = [make_dir(tmp_path / f".hf.needle-old-{pid}-abcdef0{i}") for i, pid in enumerate(dead)]
    for i, pid in enumerate(dead):  # both swaps cut short: their new outputs are still there too
        make_dir(tmp_path / f".hf.needle-tmp-{pid}-abcdef1{i}")
    with atomic.atomic_output(tmp_path / "hf", force=False, directory=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert all(p.is_dir() for p in moved)  # can't tell which was the latest output: delete neither


def test_moved_aside_copy_of_a_finished_swap_is_never_restored(tmp_path):
    """No tmp of its pid left means its swap completed: the copy is superseded even when dst is gone since
    (the user deleted it), and must not come back as if it were the user's output."""
    dead = dead_pid()
    moved = make_dir(tmp_path / f".hf.needle-old-{dead}-abcdef01")
    with atomic.atomic_output(tmp_path / "hf", force=False, directory=True) as tmp:
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
    assert not moved.exists() and (tmp_path / "hf" / "config.json").read_text() == "{}"


def test_symlinked_output_cut_short_mid_swap_comes_back_as_the_link(tmp_path):
    dead = dead_pid()
    real = make_dir(tmp_path / "real_ckpt")
    make_dir(tmp_path / f".hf.needle-tmp-{dead}-abcdef02")  # the new output, never renamed into place
    (tmp_path / f".hf.needle-old-{dead}-abcdef01").symlink_to(real, target_is_directory=True)
    with pytest.raises(atomic.OutputExistsError, match="pass --force"), \
            atomic.atomic_output(tmp_path / "hf", force=False, directory=True):
        pytest.fail("the restored output must be protected like any existing output")
    assert (tmp_path / "hf").is_symlink() and (tmp_path / "hf").resolve() == real.resolve()
    assert leftovers(tmp_path) == []


# ----------------------------------------------------------------------------- CLI, real processes


def test_cli_convert_removes_dead_writers_temps(tmp_path):
    dead, live = dead_pid(), os.getpid()
    dst = tmp_path / "m.safetensors"
    removed = [make_file(tmp_path / f".m.safetensors.needle-tmp-{dead}-0123abcd"),
               make_dir(tmp_path / f".m.safetensors.needle-tmp-{dead}-89abcdef")]
    kept = [make_file(tmp_path / f".m.safetensors.needle-tmp-{live}-0123abcd"),
            make_file(tmp_path / f".n.safetensors.needle-tmp-{dead}-0123abcd"),
            make_file(tmp_path / f".m.safetensors.needle-tmp-{dead}-0123abcd~")]
    result = run_cli("convert", FIXTURE_PKL, dst)
    assert result.returncode == 0, result.stderr
    assert [p for p in removed if p.exists()] == []
    assert [p for p in kept if not p.exists()] == []
    assert_is_fixture(dst)


# The real CLI in a real process, paused at one chosen point of the write so that SIGKILL lands there every time
# (racing a kill against a tiny write would be flaky); the kill itself is a real, uncatchable SIGKILL.
_PAUSING_CLI = textwrap.dedent("""
    import os, runpy, sys, time
    flag, point = os.environ["NEEDLE_TEST_FLAG"], os.environ["NEEDLE_TEST_PAUSE"]

    def pause():
        open(flag, "w").close()
        time.sleep(120)

    import convert.atomic
    if point == "commit":  # the output is fully written into its temporary, not yet renamed
        convert.atomic._commit = lambda *args, **kwargs: pause()
    else:
        real_rename = os.rename

        def rename(src, dst, *args, **kwargs):
            real_rename(src, dst, *args, **kwargs)
            if point == "swap" and ".needle-old-" in os.fspath(dst):  # previous output moved aside, new not in place
                pause()
            if point == "after-swap" and ".needle-tmp-" in os.fspath(src):  # new in place, old not yet deleted
                pause()

        os.rename = rename
    sys.argv = ["needle-twin", *sys.argv[1:]]
    runpy.run_module("cli", run_name="__main__")
""")


def kill_cli_at(point: str, tmp_path: Path, *args: str | Path) -> int:
    """Run `needle-twin ARGS`, SIGKILL it at point; return its (now dead) pid."""
    flag = tmp_path / f"paused-{point}"
    env = {**os.environ, "NEEDLE_TEST_FLAG": str(flag), "NEEDLE_TEST_PAUSE": point}
    proc = subprocess.Popen([sys.executable, "-c", _PAUSING_CLI, *map(str, args)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60  # generous: the child imports numpy/safetensors on a shared 2-core machine
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if not flag.exists():
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the writer never reached {point!r} (rc {proc.returncode}): {err[-2000:]}")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


def test_sigkill_before_commit_leaves_a_temp_that_the_next_run_removes(tmp_path):
    dst = tmp_path / "m.safetensors"
    pid = kill_cli_at("commit", tmp_path, "convert", FIXTURE_PKL, dst)
    left = leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".m.safetensors.needle-tmp-{pid}-")
    assert not dst.exists()
    result = run_cli("convert", FIXTURE_PKL, dst)  # no --force: nothing was ever at dst
    assert result.returncode == 0, result.stderr
    assert leftovers(tmp_path) == []
    assert_is_fixture(dst)


def test_sigkill_mid_directory_swap_puts_the_previous_output_back(tmp_path):
    dst = tmp_path / "hf"
    assert run_cli("convert", FIXTURE_PKL, dst).returncode == 0  # the user's previous output (float16)
    pid = kill_cli_at("swap", tmp_path, "convert", FIXTURE_PKL, dst, "--force", "--dtype", "bfloat16")
    assert not dst.exists()
    assert sorted(name.rsplit("-", 1)[0] for name in leftovers(tmp_path)) == \
        [f".hf.needle-old-{pid}", f".hf.needle-tmp-{pid}"]
    again = run_cli("convert", FIXTURE_PKL, dst)  # previous output is back, so this needs --force as before
    assert again.returncode == 2 and "already exists; pass --force" in again.stderr
    assert leftovers(tmp_path) == []
    assert_is_fixture(dst)  # the float16 original, intact
    assert run_cli("convert", FIXTURE_PKL, dst, "--force", "--dtype", "bfloat16").returncode == 0
    assert leftovers(tmp_path) == []
    assert_is_fixture(dst, dtype="bfloat16")


def test_sigkill_after_directory_swap_deletes_the_replaced_copy(tmp_path):
    dst = tmp_path / "hf"
    assert run_cli("convert", FIXTURE_PKL, dst).returncode == 0
    pid = kill_cli_at("after-swap", tmp_path, "convert", FIXTURE_PKL, dst, "--force", "--dtype", "bfloat16")
    left = leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".hf.needle-old-{pid}-")
    assert_is_fixture(dst, dtype="bfloat16")  # the killed run had committed
    result = run_cli("convert", FIXTURE_PKL, tmp_path / "hf", "--force")
    assert result.returncode == 0, result.stderr
    assert leftovers(tmp_path) == []
    assert_is_fixture(dst)
