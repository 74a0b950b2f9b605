"""What the built-in op declarations share: the standard backend set, device-dependent shape lists, dtypes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from autosel.buckets import TracedTokens, token_bucket
from autosel.spec import CapabilityRequirement, KernelBackend, KernelSpec

# Where autosel's Triton kernels run: CUDA and ROCm (torch exposes both as "cuda").
GPU = frozenset({CapabilityRequirement.CUDA, CapabilityRequirement.HIP})
# flashinfer and sgl-kernel ship CUDA kernels for Ampere and newer.
CUDA_SM80 = frozenset({CapabilityRequirement.cuda(min_sm=(8, 0))})
# The dtypes every built-in op's signature (OpDefinition.signature) names: what the vendors' kernels take.
DTYPES = "bf16/fp16 (fp32 on torch, torch_compile, triton)"


def standard_specs(op: str, fn: str, *, triton: bool = True, flashinfer: str | None = None,
                   sgl_kernel: str | None = None) -> list[KernelSpec]:
    """torch first (the default that challengers must beat), then torch_compile, triton and the vendors."""
    specs = [
        KernelSpec(op, KernelBackend.TORCH, f"autosel.ops.torch_impl:{fn}", requires=("torch",),
                   description="pure torch (the reference)"),
        KernelSpec(op, KernelBackend.TORCH_COMPILE, f"autosel.ops.compiled:{fn}", requires=("torch",),
                   description="torch.compile of the reference (dynamic shapes)"),
    ]
    if triton:
        specs.append(KernelSpec(op, KernelBackend.TRITON, f"autosel.ops.triton_kernels:{fn}", capabilities=GPU,
                                requires=("torch", "triton"), description="autosel's Triton kernel"))
    if flashinfer:
        specs.append(KernelSpec(op, KernelBackend.FLASHINFER, flashinfer, capabilities=CUDA_SM80,
                                requires=("torch", "flashinfer"), description="flashinfer"))
    if sgl_kernel:
        specs.append(KernelSpec(op, KernelBackend.SGL_KERNEL, sgl_kernel, capabilities=CUDA_SM80,
                                requires=("torch", "sgl_kernel"), description="sgl-kernel"))
    return specs


@dataclass(frozen=True)
class ShapesByDevice:
    """Representative shapes per device class: CPU hosts do not serve 16k-token GEMMs, so they time fewer."""

    gpu: tuple[dict, ...]
    cpu: tuple[dict, ...]

    def __call__(self, platform: Any) -> list[dict]:
        return [dict(s) for s in (self.cpu if platform.torch_device == "cpu" else self.gpu)]


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), in plain integers: triton.next_power_of_2 is a
    ConstexprFunction whose host call costs about 2 us (triton 3.6+), too much on a kernel's launch path."""
    return 1 << max(0, n - 1).bit_length()


def _rows_key(x, tokens_key) -> tuple:
    shape = x.shape
    if len(shape) == 2:
        tokens, width = shape
    else:
        width = shape[-1]
        tokens = x.numel() // max(width, 1)
    return tokens_key(tokens), width


def rows_bucket(x, *rest, **kwargs) -> tuple:
    """The bucket of a call on the rows of `x` ([tokens, width] or [..., width]): (token_bucket(tokens), width).
    A dispatcher runs it once per distinct shape (route_key=0), or per call given by keyword."""
    return _rows_key(x, token_bucket)


rows_bucket.traced = lambda x, *rest, **kwargs: _rows_key(x, TracedTokens)  # what torch.compile traces


def dtype_name(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def dtype_of(shape: dict):
    import torch

    return getattr(torch, shape.get("dtype", "bfloat16"))


def pin_triton_cache_dir() -> None:
    """Keep Triton's on-disk cache in one directory for the whole process: set TRITON_CACHE_DIR, when unset, to
    where Triton puts it by default. Called when the torch_compile or triton backend is loaded, before either
    compiles.

    torch.compile's inductor sets TRITON_CACHE_DIR to a directory of its own the first time it builds a Triton
    kernel in a process; kernels built before that went to Triton's default. How far a tune had got by then
    differed between a cold tune and the next one, so the next one missed much of what the cold one had cached
    (autosel's Triton kernels, the mm's autotuning choices) and built it again (py-spy on the H200, commit 8f85c10).
    """
    if "TRITON_CACHE_DIR" in os.environ:
        return
    try:
        from triton import knobs

        directory = knobs.cache.dir
    except (ImportError, AttributeError):  # no Triton, or one without knobs: inductor's setting stands
        return
    os.environ["TRITON_CACHE_DIR"] = directory
