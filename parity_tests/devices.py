"""Devices and matmul precision for parity runs: which accelerators the twins can use, and full-precision pins.

Shared by every family's runs, the pytest suite and the CLI.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from convert.errors import NeedleTwinError

TORCH_DEVICES = ("cpu", "cuda", "mps")
JAX_PLATFORMS = ("cpu", "gpu", "tpu")


class DeviceError(NeedleTwinError, RuntimeError):
    """A requested device is not available to this install."""


@contextmanager
def pinned_precision(enabled: bool = True) -> Iterator[None]:
    """Full float32 matmuls in both libraries (no TF32, no bf16 passes, no reduced-precision reductions).

    Restores the previous settings on exit, so library users keep their own configuration.
    """
    import jax
    import torch

    cuda = torch.backends.cuda.matmul
    saved = (jax.config.jax_default_matmul_precision, torch.get_float32_matmul_precision(), cuda.allow_tf32,
             torch.backends.cudnn.allow_tf32, cuda.allow_fp16_reduced_precision_reduction,
             cuda.allow_bf16_reduced_precision_reduction)
    if enabled:
        jax.config.update("jax_default_matmul_precision", "highest")
        torch.set_float32_matmul_precision("highest")
        cuda.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        cuda.allow_fp16_reduced_precision_reduction = cuda.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        jax.config.update("jax_default_matmul_precision", saved[0])
        torch.set_float32_matmul_precision(saved[1])
        cuda.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[2], saved[3]
        cuda.allow_fp16_reduced_precision_reduction, cuda.allow_bf16_reduced_precision_reduction = saved[4:]


def precision_settings() -> dict[str, Any]:
    """The settings in force now, as recorded in every report."""
    import jax
    import torch

    cuda = torch.backends.cuda.matmul
    return {
        "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
        "torch_float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch_cuda_matmul_allow_tf32": cuda.allow_tf32,
        "torch_cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "torch_allow_fp16_reduced_precision_reduction": cuda.allow_fp16_reduced_precision_reduction,
        "torch_allow_bf16_reduced_precision_reduction": cuda.allow_bf16_reduced_precision_reduction,
    }


def torch_device(name: str):
    """torch.device for cpu / cuda[:N] / mps, or a DeviceError saying what this install has."""
    import torch

    kind, _, index = name.partition(":")
    if kind not in TORCH_DEVICES or (index and (kind != "cuda" or not index.isdigit())):
        raise DeviceError(f"--torch-device {name!r} is not one of cpu, cuda, cuda:N, mps")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--torch-device {name}: this torch ({torch.__version__}) sees no CUDA device; "
                              "use --torch-device cpu or install a CUDA build of torch")
        if index and int(index) >= torch.cuda.device_count():
            raise DeviceError(f"--torch-device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise DeviceError("--torch-device mps: MPS is not available (needs Apple silicon and a macOS torch build); "
                          "use --torch-device cpu")
    return torch.device(name)


def jax_device(platform_name: str):
    """The first JAX device of a platform (cpu, gpu, tpu), or a DeviceError listing what JAX sees."""
    import jax

    if platform_name not in JAX_PLATFORMS:
        raise DeviceError(f"--jax-platform {platform_name!r} is not one of {', '.join(JAX_PLATFORMS)}")
    try:
        return jax.devices(platform_name)[0]
    except RuntimeError:
        seen = sorted({d.platform for d in jax.devices()})
        raise DeviceError(f"--jax-platform {platform_name}: JAX sees no {platform_name} device (it sees "
                          f"{', '.join(seen)}); use --jax-platform {seen[0]} or install jax with "
                          f"{platform_name} support") from None
