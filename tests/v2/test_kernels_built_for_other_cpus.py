"""The C++ kernels built as an AVX2-only CPU builds them, on any AVX2 CPU: their tests against the twin's pieces run
again in a process whose inductor builds 8-float vectors (ATEN_CPU_CAPABILITY=avx2) as x86-64-v3 code
(TORCHINDUCTOR_CPP_MARCH), so without AVX-512's EVEX encodings and its 16 extra vector registers. The kernels size
their register tiles by the build's register file (prefill_attention.cpp), so an AVX-512 machine's own run of these
tests checks one of the two builds; this one checks the other."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from needle_torch.fast.kernels import cpu_flags

REPO = Path(__file__).resolve().parents[2]
AVX2_CODE = {"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2"}
FILES = ("tests/v2/test_cpu_prefill.py", "tests/v2/test_cpu_attention.py", "tests/v2/test_cpu_hadamard.py",
         "tests/v2/test_cpu_sinkhorn.py", "tests/v2/test_cpu_decode.py")
# Each kernel's tests against the twin's own pieces and float64 references (the compiled-graph and build-rule tests
# do not depend on the build's vectors, and run in the suite's own process); of the bf16 products without AMX tiles
# only the upcast loads (the bf16 dot products need avx512_bf16, which an AVX2 CPU lacks).
SELECT = "kernel_is_the_twins or each_kernel_is_the_eager_piece or (without_tiles and upcast)"
HIGH_REGISTER = re.compile(r"%(zmm\d+|ymm(1[6-9]|2\d|3[01]))\b")


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="this CPU runs no AVX2 code")
def test_the_kernels_built_as_avx2_code_pass_their_tests(tmp_path):
    assert shutil.which("objdump"), "objdump (binutils, which gcc needs anyway) reads the builds' instructions"
    cache = tmp_path / "inductor"
    report = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-k", SELECT,
           f"--junitxml={report}", *FILES]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **AVX2_CODE, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    # A case may skip for a CPU feature this machine lacks (the bf16 dot products without avx512_bf16), with its
    # reason; none may fail, and every kernel's file must run at least one case as AVX2 code.
    ran: dict[str, int] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = [c for c in case if c.tag in ("failure", "error", "skipped")]
        assert all(c.tag == "skipped" and c.get("message") for c in outcome), \
            f"{case.get('name')}: {[(c.tag, c.get('message')) for c in outcome]} (failed as AVX2 code)"
        if not outcome:
            name = case.get("classname").replace(".", "/") + ".py"
            ran[name] = ran.get(name, 0) + 1
    assert set(ran) == set(FILES), ran  # every kernel's tests ran

    # What they ran is AVX2 code: 8-float ymm vectors, none of AVX-512's registers. (The cache's other builds are
    # inductor's ISA probes, each built for the ISA it probes.)
    builds = sorted(cache.rglob("*.main.so"))
    assert builds
    vectors = 0
    for so in builds:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                              check=True).stdout
        assert not HIGH_REGISTER.search(text), f"{so.name} uses AVX-512 registers"
        vectors += text.count("%ymm")
    assert vectors > 1000, vectors
