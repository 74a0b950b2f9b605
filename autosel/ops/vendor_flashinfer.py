"""flashinfer's norms, gated activations and rope as autosel calls them: PDL off, and straight to the compiled
function behind flashinfer's Python wrapper.

PDL: flashinfer 0.7 launches these kernels with programmatic dependent launch by default on sm_90 and newer: a
PDL kernel may start while the kernel before it finishes. In the tuner's graph replays each call follows a copy
of itself, and the two overlap; in a model the kernel before it is a GEMM or another op, and the overlap the
tuner measured is not there. Off, a flashinfer kernel is timed as it runs (commit b68b283).

The compiled function: each of flashinfer's wrappers ends in one call of a tvm-ffi function of a JIT module
(`get_norm_module().rmsnorm(out, input, weight, eps, enable_pdl)` and so on). Before it, on every call, the wrapper
asks torch for the device's compute capability (the norms), checks arguments the kernel checks again and takes
views. A launch-bound eager call costs its host time, so autosel calls the function itself, looked up once, on the
first call (2-4.7 us less per call on the H200's host; commit 60e629d). Where this flashinfer does not
have it where 0.7 does, the public wrapper is called, with a warning; where flashinfer runs its CuTe DSL norm
kernels instead of the JIT module (nvidia-cutlass-dsl installed, and FLASHINFER_USE_CUDA_NORM unset), the norms go
through the public wrapper too, so that they run what flashinfer would.

Loaded only when the flashinfer backend is loaded.
"""

from __future__ import annotations

import warnings
from typing import Callable

import flashinfer
import torch


def _norm_function(name: str) -> Callable:
    device = torch.device("cuda", torch.cuda.current_device())
    if not flashinfer.norm._use_cuda_norm(device):
        return _PUBLIC[name]  # the CuTe DSL kernels: flashinfer's own choice for this device
    return getattr(flashinfer.norm.get_norm_module(), name)


# Per name: how to find the compiled function (_LOOKUPS), and the public wrapper called with the compiled
# function's arguments (_PUBLIC), for a flashinfer that has it elsewhere.
_LOOKUPS: dict[str, Callable[[], Callable]] = {
    "rmsnorm": lambda: _norm_function("rmsnorm"),
    "fused_add_rmsnorm": lambda: _norm_function("fused_add_rmsnorm"),
    "silu_and_mul": lambda: flashinfer.activation.gen_act_and_mul_module("silu").build_and_load().silu_and_mul,
    "gelu_and_mul": lambda: flashinfer.activation.gen_act_and_mul_module("gelu").build_and_load().gelu_and_mul,
    "apply_rope_pos_ids_cos_sin_cache": lambda: flashinfer.rope.get_rope_module().apply_rope_pos_ids_cos_sin_cache,
}
_PUBLIC: dict[str, Callable] = {
    "rmsnorm": lambda out, x, weight, eps, pdl: flashinfer.norm.rmsnorm(x, weight, eps, out=out, enable_pdl=pdl),
    "fused_add_rmsnorm": lambda x, residual, weight, eps, pdl: flashinfer.norm.fused_add_rmsnorm(
        x, residual, weight, eps, enable_pdl=pdl),
    "silu_and_mul": lambda out, x, pdl: flashinfer.activation.silu_and_mul(x, out=out, enable_pdl=pdl),
    "gelu_and_mul": lambda out, x, pdl: flashinfer.activation.gelu_and_mul(x, out=out, enable_pdl=pdl),
    "apply_rope_pos_ids_cos_sin_cache": lambda q, k, _q_out, _k_out, cache, positions, interleave:
        flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
            positions, q.view(q.shape[0], -1), k.view(k.shape[0], -1), q.shape[-1], cache, not interleave),
}


class _Compiled(dict):
    """name -> flashinfer's compiled function, looked up on first use (a JIT module may build then)."""

    def __missing__(self, name: str) -> Callable:
        try:
            fn = _LOOKUPS[name]()
        except (AttributeError, ImportError, TypeError) as exc:  # flashinfer's internals moved
            warnings.warn(
                f"flashinfer {getattr(flashinfer, '__version__', '?')}: {name}'s compiled function is not where "
                f"flashinfer 0.7 has it ({type(exc).__name__}: {exc}); calling flashinfer's public wrapper, which "
                "costs more host time per call. Install flashinfer 0.7 for the direct call.", stacklevel=3)
            fn = _PUBLIC[name]
        self[name] = fn
        return fn


_compiled = _Compiled()


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _compiled["rmsnorm"](out, x, weight, eps, False)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _compiled["fused_add_rmsnorm"](x, residual, weight, eps, False)


def _act_and_mul(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: the last dimension must be even (2 * hidden size), got {x.shape[-1]}")
    out = x.new_empty(x.shape[:-1] + (x.shape[-1] // 2,))
    _compiled[name](out, x, False)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "silu_and_mul")


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, "gelu_and_mul")


def rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
         cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """In place on query and key, as flashinfer.rope.apply_rope_with_cos_sin_cache_inplace."""
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32, got {cos_sin_cache.dtype}")
    q, k = query.view(query.shape[0], -1, head_size), key.view(key.shape[0], -1, head_size)
    _compiled["apply_rope_pos_ids_cos_sin_cache"](q, k, q, k, cos_sin_cache, positions, not is_neox)
