"""Torch-only speed code for the twins, behind one seam: what makes torch fast and is not the model's definition.

`kernels` decides per CPU and per compiled graph which form a product, attention or Walsh transform takes; the
cpu_* modules build the C++ kernels of csrc/ through inductor's toolchain and enter compiled graphs as custom ops.
Every form computes the same function as the plain one (up to the order of float32 sums); `kernels.enabled`
switches all of them off, which `generate(..., fast=False)` does for one request.
"""
