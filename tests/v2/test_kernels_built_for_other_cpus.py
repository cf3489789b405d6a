"""The C++ kernels built as other x86-64 CPUs build them, checked against the twin's pieces on this one.

The suite's own process builds and checks the kernels as this CPU runs them (AVX-512 with or without AVX512-BF16,
or AVX2). Each kind below reruns a few of those cases in a process whose inductor builds for that kind
(TORCHINDUCTOR_CPP_MARCH, ATEN_CPU_CAPABILITY) and whose bf16 products take that kind's path, where this CPU can
run the kind's code:
  avx2          x86-64-v3 code: 8-float vectors, 16 registers, no bf16 units
  avx512-no-bf16  x86-64-v4 code: AVX-512 without the AVX512-BF16 instructions (a common cloud VM); only on a CPU
                that has AVX512-BF16, since elsewhere the suite's own run is this kind
A case may skip for a feature the kind lacks, with its reason; none may fail. Where this CPU has AVX512-BF16, the
suite's own run checks the AVX-512+BF16 builds.
"""

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
FLAGS = cpu_flags()
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}

# One small case per dtype: each distinct shape is a build of its own, the cost of this test. On both kinds bf16
# products take the upcast loads (no bf16 units), so cpu_decode's bf16 case covers that path.
F32_CASES = ("tests/v2/test_cpu_decode.py::test_each_kernel_is_the_eager_piece[tiny-3-float32]",)
BF16_CASES = ("tests/v2/test_cpu_decode.py::test_each_kernel_is_the_eager_piece[tiny-3-bf16]",)
# kind -> (environment of its process, flags this CPU needs to run its code, why it skips otherwise,
#          instructions its builds must not contain (None: no check), its cases: AVX-512 float32 code without
#          AVX512-BF16 is this CPU's own, so that kind reruns the bf16 cases only)
KINDS = {
    "avx2": ({"ATEN_CPU_CAPABILITY": "avx2", "TORCHINDUCTOR_CPP_MARCH": "x86-64-v3", "ONEDNN_MAX_CPU_ISA": "AVX2"},
             {"avx2", "fma"}, "this CPU runs no AVX2 code",
             re.compile(r"%(zmm\d+|ymm(1[6-9]|2\d|3[01]))\b"),  # AVX-512's registers
             F32_CASES + BF16_CASES),
    "avx512-no-bf16": ({"TORCHINDUCTOR_CPP_MARCH": "x86-64-v4", "NEEDLE_TWIN_BF16": "upcast",
                        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"},
                       AVX512 | {"avx512_bf16"}, "this CPU is that kind itself (the suite's own run builds it) or has "
                       "no AVX-512",
                       None,  # the dot-product functions are built by their own target attribute, never called here
                       BF16_CASES),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_kernels_built_for_another_cpu_kind_pass_their_tests(kind, tmp_path):
    env, needs, why, forbidden, cases = KINDS[kind]
    if not needs <= FLAGS:
        pytest.skip(f"{kind}: {why}")
    assert shutil.which("objdump"), "objdump (binutils, which gcc needs anyway) reads the builds' instructions"
    cache = tmp_path / "inductor"
    report = tmp_path / "report.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", f"--junitxml={report}", *cases]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **env, "TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]

    ran: dict[str, int] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = [c for c in case if c.tag in ("failure", "error", "skipped")]
        assert all(c.tag == "skipped" and c.get("message") for c in outcome), \
            f"{case.get('name')}: {[(c.tag, c.get('message')) for c in outcome]} (failed as {kind} code)"
        if not outcome:
            name = case.get("classname").replace(".", "/") + ".py"
            ran[name] = ran.get(name, 0) + 1
    assert set(ran) == {case.split("::")[0] for case in cases}, ran  # every kernel's cases ran

    # What they ran is that kind's code. (The cache's other builds are inductor's ISA probes, each built for the ISA
    # it probes.)
    builds = sorted(cache.rglob("*.main.so"))
    assert builds
    vectors = 0
    for so in builds:
        text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(so)], capture_output=True, text=True,
                              check=True).stdout
        found = forbidden.search(text) if forbidden else None
        assert not found, f"{so.name} uses {found.group(0)}, which {kind} CPUs lack"
        vectors += len(re.findall(r"%[yz]mm", text))
    assert vectors > 1000, vectors  # vector code, not scalar fallbacks
