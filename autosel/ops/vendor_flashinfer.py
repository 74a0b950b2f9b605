"""flashinfer's norms and gated activations as autosel calls them: with programmatic dependent launch (PDL) off.

flashinfer 0.7 launches these kernels with PDL by default on sm_90 and newer: a PDL kernel may start while the
kernel before it finishes. In the tuner's graph replays each call follows a copy of itself, and the two overlap;
in a model the kernel before it is a GEMM or another op, and the overlap the tuner measured is not there.
Off, a flashinfer kernel is timed as it runs (docs/H200.md, "PDL").

Loaded only when the flashinfer backend is loaded.
"""

from __future__ import annotations

import flashinfer
import torch


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return flashinfer.norm.rmsnorm(x, weight, eps, enable_pdl=False)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps, enable_pdl=False)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return flashinfer.activation.silu_and_mul(x, enable_pdl=False)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return flashinfer.activation.gelu_and_mul(x, enable_pdl=False)
