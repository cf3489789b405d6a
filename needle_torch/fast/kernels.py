"""Torch-only speed code: bf16 and float32 products picked by the CPU, reductions under torch.compile, compiled steps.

Nothing here changes what a model computes, only how: a bf16 product is float32 products and
sums rounded once to bf16 whichever kernel computes it, the reduction form equals the library
matmul up to the order of the float32 sum, and a compiled step is the eager step traced once.
"""

from __future__ import annotations

import functools
import math
import os
import re
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

# ----------------------------------------------------------------------------- the switch the fast forms read

# The fast forms below ask enabled() first; seam.fast_paths(model, False) turns them off for one request, so that
# what generate runs itself (chunked prefills, compiled-pass options) is plain too. A module global: torch.compile
# guards on it, so a graph traced with the fast forms is never reused without them.
_ENABLED = True


def enabled() -> bool:
    """Whether the fast forms of this package apply where they are called (off inside fast_paths(model, False))."""
    return _ENABLED


@contextmanager
def switched(on: bool) -> Iterator[None]:
    """Run the block with enabled() answering `on` (restored after, also on an error)."""
    global _ENABLED
    before, _ENABLED = _ENABLED, bool(on)
    try:
        yield
    finally:
        _ENABLED = before


# ----------------------------------------------------------------------------- bf16 products by CPU capability

# CPUs whose bf16 products oneDNN runs in hardware (AVX512-BF16 dot products, AMX tiles). Elsewhere it emulates
# them, slower than float32; XLA upcasts on such CPUs, and so does the "upcast" path.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN's ISA names in order (ONEDNN_MAX_CPU_ISA caps the kernels it dispatches to); bf16 units from here on.
_ONEDNN_ISAS = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI",
                "AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX",
                "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "ALL", "DEFAULT")
BF16_PATH_ENV = "NEEDLE_TWIN_BF16"  # "native" or "upcast": force a path (benchmarks compare both on one CPU)


@dataclass(frozen=True)
class Bf16Path:
    """How bf16 products run on this CPU: natively (library bf16 kernels) or upcast (float32 kernels on
    upcast operands, rounded once to bf16: the same function, since a bf16 product accumulates in float32)."""

    native: bool
    reason: str
    features: tuple[str, ...]  # the CPU's bf16-relevant flags and ISA caps found
    tiles: bool = False  # native, and AMX tiles too (amx_bf16, amx_tile; no ONEDNN_MAX_CPU_ISA below them)

    @property
    def name(self) -> str:
        return "native" if self.native else "upcast"

    def __str__(self) -> str:
        return f"bf16 products {self.name}: {self.reason}" + ("; AMX tiles" if self.tiles else "")


def cpuinfo(field: str) -> str | None:
    """The value of `field` in /proc/cpuinfo's first processor (Linux), None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags: /proc/cpuinfo on Linux, else torch's own cpuinfo report."""
    flags = cpuinfo("flags")
    if flags is not None:
        return set(flags.split())
    report = getattr(torch.cpu, "get_capabilities", lambda: {})()
    return {name for name, on in report.items() if on is True}


def decide_bf16_path(environ: Mapping[str, str], flags: set[str], aten: str) -> Bf16Path:
    """The rule of bf16_path, given the environment, the CPU's flags and ATen's CPU capability."""
    units = tuple(f for f in NATIVE_BF16_FLAGS if f in flags)
    onednn = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    features = (*units, f"aten={aten}", *([f"onednn<={onednn}"] if onednn else []))
    tiles = {"amx_bf16", "amx_tile"} <= flags and aten == "AVX512" and not (
        onednn in _ONEDNN_ISAS and _ONEDNN_ISAS.index(onednn) < _ONEDNN_ISAS.index("AVX10_1_512_AMX"))
    forced = environ.get(BF16_PATH_ENV, "").lower()
    if forced in ("native", "upcast"):
        return Bf16Path(forced == "native", f"forced by {BF16_PATH_ENV}={forced}", features,
                        tiles and forced == "native")
    if not units:
        return Bf16Path(False, f"the CPU has none of {'/'.join(NATIVE_BF16_FLAGS)}, so library bf16 kernels would "
                               "emulate them; float32 kernels on upcast operands", features)
    if onednn in _ONEDNN_ISAS and _ONEDNN_ISAS.index(onednn) < _ONEDNN_ISAS.index("AVX512_CORE_BF16"):
        return Bf16Path(False, f"ONEDNN_MAX_CPU_ISA={onednn} keeps oneDNN below its bf16 kernels", features)
    if aten != "AVX512":
        return Bf16Path(False, f"ATEN_CPU_CAPABILITY caps ATen at {aten}", features)
    return Bf16Path(True, f"{'/'.join(units)} found: oneDNN runs bf16 products in hardware", features, tiles)


@functools.cache
def bf16_path() -> Bf16Path:
    """Which kernels bf16 products take on the CPU, and why (decided once per process, before any compile).

    Native when the CPU has bf16 units (avx512_bf16 or amx_bf16) and nothing caps the ISA below them:
    ONEDNN_MAX_CPU_ISA (oneDNN's kernels) and ATEN_CPU_CAPABILITY (ATen's and inductor's vector code) are
    honoured, so `ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2` makes this machine behave as an AVX2-only one.
    NEEDLE_TWIN_BF16=native|upcast forces a path. Products on other devices always take the library kernels."""
    return decide_bf16_path(os.environ, cpu_flags(), torch.backends.cpu.get_cpu_capability())


@torch.compiler.assume_constant_result
def _native_bf16() -> bool:
    return bf16_path().native  # a constant to torch.compile: it never traces the /proc/cpuinfo read


def upcasts(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a product in `dtype` on `device` runs as float32 kernels on upcast operands (see bf16_path)."""
    return _ENABLED and dtype == torch.bfloat16 and device.type == "cpu" and not _native_bf16()


def product_path(dtype: torch.dtype) -> int:
    """How the C++ kernels' bf16 products run here (cpu_decode's Fused.dp): 0 float32
    multiply-adds on upcast loads, 1 the CPU's AVX512-BF16 dot products, 2 AMX tiles too. The dot products need the
    CPU's own units, whatever NEEDLE_TWIN_BF16 forces."""
    path = bf16_path()
    if dtype != torch.bfloat16 or not path.native or "avx512_bf16" not in path.features:
        return 0
    return 2 if path.tiles else 1


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in their dtype, through float32 kernels where bf16 products would be emulated (bf16_path)."""
    if upcasts(a.dtype, a.device):
        return (a.float() @ b.float()).to(a.dtype)
    return a @ b


# The products UpcastProducts reroutes: each one accumulates in float32 and rounds its result once.
_PRODUCTS = frozenset({torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm, Tensor.bmm, torch.mm, Tensor.mm,
                       F.linear, torch.einsum})


class UpcastProducts(TorchFunctionMode):
    """While active, every product of bf16 CPU tensors that bf16_path upcasts runs as the float32 product of the
    upcast operands rounded once to bf16: the same function, through float32 kernels (also inside torch.compile,
    which traces the mode). An einsum of three or more operands rounds between its products, so it passes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _PRODUCTS:
            return func(*args, **kwargs)
        operands = args[1:] if func is torch.einsum else args
        if func is torch.einsum and len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = tuple(operands[0])  # einsum(eq, [a, b])
        tensors = [t for t in (*operands, *kwargs.values()) if isinstance(t, Tensor)]
        if not tensors or (func is torch.einsum and len(tensors) != 2) or not all(
                upcasts(t.dtype, t.device) for t in tensors):
            return func(*args, **kwargs)
        up = [t.float() if isinstance(t, Tensor) else t for t in operands]
        wide = {k: v.float() if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        return (torch.einsum(args[0], *up) if func is torch.einsum else func(*up, **wide)).to(torch.bfloat16)


# ----------------------------------------------------------------------------- float32 products by CPU vendor

# torch's float32 products on x86 CPUs are MKL's, and MKL runs its AVX-512 kernels on Intel CPUs only; oneDNN, also
# inside torch, picks its kernels by ISA alone. So compiled CPU graphs route their float32 products through oneDNN on
# CPUs that are not Intel's (onednn_linear); eager code keeps the library product. Both sum in float32.
F32_PATH_ENV = "NEEDLE_TWIN_F32"  # "onednn" or "library": force a path (benchmarks and tests compare both)


@dataclass(frozen=True)
class F32Path:
    """Which kernels a compiled CPU graph's float32 products take: oneDNN's matmul, or the library's (MKL)."""

    onednn: bool
    reason: str

    @property
    def name(self) -> str:
        return "onednn" if self.onednn else "library"

    def __str__(self) -> str:
        return f"float32 products {self.name}: {self.reason}"


def decide_f32_path(environ: Mapping[str, str], vendor: str, onednn_available: bool) -> F32Path:
    """The rule of f32_path, given the environment, the CPU's vendor id and whether torch has oneDNN."""
    forced = environ.get(F32_PATH_ENV, "").lower()
    if not onednn_available:
        return F32Path(False, "this torch has no oneDNN or lacks its private ops (kernels.ONEDNN_OPS)")
    if forced in ("onednn", "library"):
        return F32Path(forced == "onednn", f"forced by {F32_PATH_ENV}={forced}")
    if vendor in ("GenuineIntel", ""):
        return F32Path(False, "an Intel CPU: MKL runs its widest kernels" if vendor else "the CPU's vendor is unknown")
    return F32Path(True, f"a {vendor} CPU: MKL keeps its AVX-512 kernels for Intel's, oneDNN picks by ISA")


# The private oneDNN ops onednn_linear and packs_bf16 call; without any of them (another torch) products take the
# library's kernels (F.linear), the same function.
ONEDNN_OPS = ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")


def onednn_ops() -> bool:
    """Whether this torch has oneDNN and every private op of ONEDNN_OPS (torch.ops.mkldnn)."""
    if not torch.backends.mkldnn.is_available():
        return False
    namespace = getattr(torch.ops, "mkldnn", None)
    for name in ONEDNN_OPS:
        try:
            if getattr(namespace, name, None) is None:
                return False
        except (AttributeError, RuntimeError):  # an _OpNamespace raises for an op it does not know
            return False
    return True


@functools.cache
def f32_path() -> F32Path:
    """Which kernels float32 products of compiled CPU graphs take (decided once per process, before any compile):
    oneDNN on CPUs whose vendor is not Intel, MKL (the library's product) on Intel's. NEEDLE_TWIN_F32=onednn|library
    forces a path. Eager code and other devices always take the library product."""
    return decide_f32_path(os.environ, cpuinfo("vendor_id") or "", onednn_ops())


@torch.compiler.assume_constant_result
def _onednn_f32() -> bool:
    return f32_path().onednn  # a constant to torch.compile


# oneDNN multiplies few rows faster by a weight already reordered into its blocked layout for that row count than by
# one it reorders on every call. So onednn_linear keeps a packed copy of every nn.Parameter it multiplies by at up to
# PACK_MAX_ROWS rows, for the last row count seen, until the parameter dies, changes (version counter, storage) or
# meets another row count. Only parameters: compiled code can rewrite an intermediate's buffer without its version
# counter knowing. The copies cost the weights' size again (a bf16 model's on the upcast path twice: float32 copies).
PACK_MAX_ROWS = 64
# first parameter -> ((version, data_ptr) of each, weak references to the others, rows, packed weight)
_PACKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def packed_weight(ws: Tensor | Sequence[Tensor], rows: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weights ws (each (O_i, I)) stacked along O in `dtype` (float32: bf16 weights upcast exactly; bf16: as
    they are), in oneDNN's layout for products of `rows` rows and kept for reuse, where every one is a parameter and
    rows <= PACK_MAX_ROWS; else stacked plainly (one weight already in `dtype`: itself, contiguous). A stack's copy
    is renewed when any of its parameters changes or is another object, or at another row count or dtype."""
    ws = (ws,) if isinstance(ws, Tensor) else tuple(ws)
    if rows > PACK_MAX_ROWS or not all(
            isinstance(w, nn.Parameter) and not w.is_inference() and w.is_contiguous() for w in ws):
        return _stack(ws, dtype)
    stamp = tuple((w._version, w.data_ptr()) for w in ws)
    kept = _PACKED.get(ws[0])
    if (kept is None or kept[0] != stamp or kept[2] != rows or kept[3].dtype != dtype
            or any(ref() is not w for ref, w in zip(kept[1], ws[1:], strict=True))):
        kept = _PACKED[ws[0]] = (stamp, tuple(weakref.ref(w) for w in ws[1:]), rows,
                                 torch.ops.mkldnn._reorder_linear_weight(_stack(ws, dtype), rows))
    return kept[3]


def _stack(ws: tuple[Tensor, ...], dtype: torch.dtype) -> Tensor:
    """The weights stacked along the output axis in `dtype`, contiguous (one weight already in `dtype` and
    contiguous: itself, no copy; bf16 weights to float32: exactly upcast, see linear_f32)."""
    if len(ws) == 1:
        return ws[0].detach().to(dtype).contiguous()
    return torch.cat([w.detach() for w in ws]).to(dtype)


@torch.library.custom_op("needle_twin::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, ws: list[Tensor], bias: Tensor | None = None) -> Tensor:
    """x (R, I) @ [w_1; w_2; ...]ᵀ (+ bias (ΣO,)) -> (R, ΣO) in x's dtype, through oneDNN's matmul, against a kept
    packed copy of the stacked weights at few rows (packed_weight): float32 x (the weights float32, or bf16 upcast
    exactly; see F32_PATH_ENV) or bf16 x with bf16 weights and bias (packs_bf16). A custom op: inductor lowers
    oneDNN's own linear only for frozen (constant) weights."""
    x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(ws, x.shape[0], x.dtype), bias, "none", [], "")


@onednn_linear.register_fake
def _(x: Tensor, ws: list[Tensor], bias: Tensor | None = None) -> Tensor:
    return x.new_empty((x.shape[0], sum(w.shape[0] for w in ws)))


def _inference(x: Tensor, w: Tensor) -> bool:
    """Whether no gradient is recorded through x @ wᵀ (onednn_linear has no backward)."""
    return not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))


def takes_onednn(x: Tensor, w: Tensor) -> bool:
    """Whether the float32 product x (..., I) @ w (O, I)ᵀ runs through onednn_linear: in a compiled CPU graph where
    f32_path says so, for inference (the op has no backward)."""
    return compiling_for_cpu(x.device) and _onednn_f32() and _inference(x, w)


def f32_product(x: Tensor, w: Tensor) -> bool:
    """Whether x @ wᵀ runs as a float32 product (linear_f32): float32 operands, or bf16 ones on the upcast path."""
    return w.dtype == x.dtype and (x.dtype == torch.float32 or upcasts(x.dtype, x.device))


@torch.compiler.assume_constant_result
def _onednn_bf16() -> bool:
    return onednn_ops() and torch.ops.mkldnn._is_mkldnn_bf16_supported()  # a constant to torch.compile


def packs_bf16(x: Tensor, w: Tensor) -> bool:
    """Whether the bf16 product x (..., I) @ w (O, I)ᵀ runs through onednn_linear against a kept packed bf16 copy of
    w: a compiled CPU step of REDUCE_MAX_ROWS < rows <= PACK_MAX_ROWS on the native bf16 path (bf16_path) whose
    oneDNN runs bf16, for inference. The library product (inductor's extern mm) reorders w on every call."""
    return (x.dtype == w.dtype == torch.bfloat16 and REDUCE_MAX_ROWS < x.shape[:-1].numel() <= PACK_MAX_ROWS
            and compiling_for_cpu(x.device) and not upcasts(x.dtype, x.device) and _onednn_bf16() and _inference(x, w))


def linear_f32(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., I) @ w (O, I)ᵀ (+ bias) -> (..., O) for float32 x and bias, w float32 or bf16 (a bf16 product on the
    upcast path, bf16_path: the weight upcast exactly): onednn_linear where takes_onednn, else F.linear. Through
    onednn_linear a bf16 parameter's packed copy is float32, kept like a float32 one's, so that a compiled step does
    not upcast its weights again each call."""
    if takes_onednn(x, w):
        return onednn_linear(x.reshape(-1, x.shape[-1]), [w], bias).view(*x.shape[:-1], w.shape[0])
    return F.linear(x, w.float(), bias)


# ----------------------------------------------------------------------------- reductions under compile

# Under torch.compile on CPU, a product with at most this many rows (a decode step's few tokens) is written as a
# multiply-and-sum, which inductor fuses with the ops around it into one pass reading each weight once in its stored
# dtype: at this size a library call per projection is bound by its overhead. Eager code and GPUs keep the library.
REDUCE_MAX_ROWS = 4


def reduces_when_compiled(rows: int, device: torch.device) -> bool:
    """Whether a compiled product with `rows` rows on `device` is written as a multiply-and-sum (CPU, few rows)."""
    return _ENABLED and device.type == "cpu" and rows <= REDUCE_MAX_ROWS


def compiling_for_cpu(device: torch.device) -> bool:
    """Whether the code being run is traced by torch.compile for `device` on CPU: where the compiled forms of this
    package apply (reductions, and the Needle 2 Walsh, lane-mix and bf16 attention forms), all measured on CPU."""
    return _ENABLED and torch.compiler.is_compiling() and device.type == "cpu"


def graph_calls(device: torch.device, ready: Mapping, key) -> bool:
    """Whether the code being traced may call the C++ kernel built under `key` (`ready`: a kernel module's build
    record, see build_once): a compiled CPU graph, for inference (the kernels' ops have no backward), and a kernel
    that built. Each kernel module adds its own shape and dtype rules."""
    return compiling_for_cpu(device) and not torch.is_grad_enabled() and ready.get(key, False)


def as_reduction(rows: int, device: torch.device) -> bool:
    """Whether a product with `rows` rows on `device` is written as a multiply-and-sum here (compiling)."""
    return compiling_for_cpu(device) and reduces_when_compiled(rows, device)


def stored(x: Tensor) -> Tensor:
    """`x` stored once in a compiled CPU graph whose few-row products read it (as_reduction), not recomputed inside
    each of them: inductor's force_stride_order prim with x's own strides. Elsewhere, and where the prim is missing
    (another torch), `x` itself: the same function.

    Inductor inlines the ops that make a product's input into each multiply-and-sum that reads it, so a norm before
    the products would run once per weight row. Stored, it runs once, rounded to its dtype as eager's is."""
    if not as_reduction(x.shape[:-1].numel(), x.device):
        return x
    force = getattr(torch.ops.prims, "inductor_force_stride_order", None)
    return x if force is None else force(x, x.stride())


def matmul_nt(a: Tensor, b: Tensor, dtype: torch.dtype, reduce: bool = False) -> Tensor:
    """a (..., M, I) @ b (..., N, I)^T -> (..., M, N) in `dtype`: products and sums in float32, rounded once.

    That is what a `dtype` matmul computes on CPU and GPU (float32 accumulation); `reduce` writes it as
    a broadcast multiply-and-sum (see REDUCE_MAX_ROWS), equal up to the order of the float32 sum.
    """
    if reduce:
        return (a.float()[..., :, None, :] * b.float()[..., None, :, :]).sum(-1).to(dtype)
    if dtype == torch.float32 and b.dim() == 2 and takes_onednn(a, b):  # against a weight: see f32_path
        return linear_f32(a.float(), b.float())
    return matmul(a.to(dtype), b.to(dtype).transpose(-1, -2))


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose few-row products under torch.compile are reductions, whose
    bf16 products are upcast where the CPU has no bf16 units (bf16_path), and whose float32 products in compiled CPU
    graphs take oneDNN where f32_path says so."""

    def forward(self, x: Tensor) -> Tensor:
        if not as_reduction(x.shape[:-1].numel(), x.device):
            if f32_product(x, self.weight):
                bias = None if self.bias is None else self.bias.float()
                return linear_f32(x.float(), self.weight, bias).to(x.dtype)
            if packs_bf16(x, self.weight):
                y = onednn_linear(x.reshape(-1, x.shape[-1]), [self.weight], self.bias)
                return y.view(*x.shape[:-1], y.shape[-1])
            return F.linear(x, self.weight, self.bias)
        y = matmul_nt(x[..., None, :], self.weight, torch.float32, reduce=True)[..., 0, :]  # (..., O) float32
        return (y if self.bias is None else y + self.bias.float()).to(x.dtype)


def hooked(module: nn.Module | None = None) -> bool:
    """Whether calls run forward hooks: `module`'s own, or (None) global ones on every module. A parity probe
    records through them, so code that skips a module's call must not skip its hooks."""
    if module is None:
        return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)
    return bool(module._forward_hooks or module._forward_pre_hooks)


def bare_linear(module: nn.Module) -> bool:
    """Whether `module` is an nn.Linear or this package's Linear, without a bias (not a subclass, not a LoRA
    wrapper)."""
    return type(module) in (nn.Linear, Linear) and module.bias is None


# ----------------------------------------------------------------------------- prefill in row chunks

# A prefill of many prompts runs as row chunks of at most this many tokens, for the allocator: glibc mmaps every
# allocation above 32 MiB afresh, so a whole batch's intermediates fault their pages in op after op; in chunks they
# come from the heap. Each prompt's prefill reads only its own row, so the chunks give the same function.
PREFILL_TOKENS = 2048


def prefill_rows(batch: int, length: int, device: torch.device) -> int:
    """How many of `batch` prompts of `length` tokens one prefill chunk takes: PREFILL_TOKENS' worth (at least one)
    on CPU; elsewhere all of them (a GPU's caching allocator reuses its blocks; not measured here)."""
    if device.type != "cpu" or not _ENABLED:
        return batch
    return max(1, min(batch, PREFILL_TOKENS // length))  # length >= 1: every prompt has a token


# ----------------------------------------------------------------------------- C++ kernels built at run time


# The C++ scalar type of each dtype the kernels build for (their SCALAR define and pointer types).
CPP_SCALARS = {torch.float32: "float", torch.bfloat16: "c10::BFloat16"}


def cpp_defines(pairs: Iterable[tuple[str, object]]) -> str:
    """`#define NAME VALUE` lines, one per pair, in order."""
    return "".join(f"#define {name} {value}\n" for name, value in pairs)


def cpp_source(source: Path) -> str:
    """The text of a C++ file of this package with each `#include "name"` line replaced by the text of the file
    `name` beside it (the build compiles a string, which has no folder to look in)."""
    return re.sub(r'^#include "([^"]+)"$', lambda m: (source.parent / m.group(1)).read_text(), source.read_text(),
                  flags=re.MULTILINE)


def cpp_kernel(source: Path, defines: Iterable[tuple[str, object]], argtypes: Sequence[str]):
    """The extern "C" `kernel` of a C++ file of this package (csrc/) with `defines` in front and its local includes
    inlined (cpp_source), built through inductor's C++ toolchain and disk cache (once per text), callable from
    Python with arguments of `argtypes`."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    return CppPythonBindingsCodeCache.load_pybinding(list(argtypes), cpp_defines(defines) + cpp_source(source))


def walsh_entry(size: int, dtype: torch.dtype = torch.float32) -> float:
    """The entry of the normalised Walsh matrix H_size as the model holds it: float32(1/√size) cast to `dtype`."""
    return float(torch.tensor(1 / math.sqrt(size), dtype=torch.float32).to(dtype).float())


class KernelBuildWarning(RuntimeWarning):
    """A C++ kernel of needle_torch did not build: its callers keep the torch form (the same function, slower)."""


def build_once(key: str, build: Callable[[], object], built: dict, ready: dict, what: str, fallback: str) -> bool:
    """built[key] = build() the first time `key` is asked for, and ready[key] whether that worked (plain values, which
    compiled graphs can guard on). A failure (no compiler, an inductor internal that moved) warns once, with a
    KernelBuildWarning naming `what` did not build and `fallback` (what runs instead), and answers False after."""
    if key not in ready:
        try:
            built[key] = build()
            ready[key] = True
        except Exception as e:
            ready[key] = False
            first = str(e).splitlines()[0] if str(e) else ""
            warnings.warn(f"needle-twin's {what} did not build ({type(e).__name__}: {first}); {fallback}",
                          KernelBuildWarning, stacklevel=3)
    return ready[key]


# ----------------------------------------------------------------------------- compiled steps


class CompileFallbackWarning(RuntimeWarning):
    """A compiled generation request ran eagerly (slower, same function)."""


RECOMPILE_LIMIT_HIT = ("torch.compile reached its recompile limit in this process, so this request runs eagerly "
                       "(slower); use fewer distinct batch sizes, source lengths, max_new_tokens, dtypes or "
                       "mask/suppress variants per process, or raise torch._dynamo.config.recompile_limit")


def recompile_limit_errors() -> tuple[type[Exception], ...]:
    """dynamo's error past its recompile limit, a private class: () where this torch lacks it (nothing caught)."""
    error = getattr(getattr(torch._dynamo, "exc", None), "FailOnRecompileLimitHit", None)
    return () if error is None else (error,)


_compiled: dict[tuple, Callable] = {}


def compiled(fn: Callable, options: dict | None = None) -> Callable:
    """`fn` under torch.compile (one wrapper per function and options; graphs cached per shapes, dtypes and
    None-ness of its arguments, up to torch._dynamo.config.recompile_limit: past it, `CompiledStep` runs eagerly and
    warns). options: inductor settings for this function's graphs."""
    # enabled() in the key: a plain and a fast trace of one function never share a wrapper (nor its graphs)
    key = (fn, None if options is None else tuple(sorted(options.items())), _ENABLED)
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, fullgraph=True, dynamic=False, options=options)
    return _compiled[key]


def skip_guards() -> AbstractContextManager:
    """Later steps repeat step 0's call with the same model, cache and shapes: skip re-checking its ~200 tensor
    guards (about a tenth of a batch-1 step). Diff guards still pick the graph."""
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True)


class CompiledStep:
    """Calls `fn` compiled, the first call guarded (it compiles or picks the graph), later calls without guard
    evaluation; past dynamo's recompile limit the whole request runs `fn` eagerly with a CompileFallbackWarning."""

    def __init__(self, fn: Callable, options: dict | None = None) -> None:
        self.fn, self._compiled, self._calls = fn, compiled(fn, options), 0

    def __call__(self, *args):
        self._calls += 1
        if self._compiled is None:
            return self.fn(*args)
        if self._calls > 1:
            with skip_guards():  # only around our own call: a streamer's compiled code keeps its guards
                return self._compiled(*args)
        try:
            return self._compiled(*args)
        except recompile_limit_errors():
            warnings.warn(RECOMPILE_LIMIT_HIT, CompileFallbackWarning, stacklevel=3)
            self._compiled = None  # eager with the same arguments, for the whole request
            return self.fn(*args)
