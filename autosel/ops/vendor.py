"""Adapters for vendor kernels whose call does not match autosel's canonical signature (sgl-kernel 0.4).

Loaded only when one of these backends is loaded; flashinfer's calls are in vendor_flashinfer.
"""

from __future__ import annotations

import sgl_kernel  # noqa: F401  (registers the torch.ops.sgl_kernel operators)
import torch


def sgl_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # sgl_kernel.rmsnorm hands the call to flashinfer whenever flashinfer imports; the op is sgl's own kernel.
    out = torch.empty_like(x)
    torch.ops.sgl_kernel.rmsnorm.default(out, x, weight, eps, False)  # PDL off: vendor_flashinfer says why
    return out


def sgl_fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    torch.ops.sgl_kernel.fused_add_rmsnorm.default(x, residual, weight, eps, False)  # PDL off


# The kernel's own working copy (keyed by the tensor's address and version, so never stale), not what autosel
# remembers of its choices (autosel.state): clear_cache() leaves a kernel's memory alone.
_cache_in_dtype: dict[tuple, torch.Tensor] = {}


def sgl_rope(positions, query, key, head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """sgl-kernel 0.4's rotary_embedding needs the cache in the query's dtype; the cast is kept, as an engine
    would keep its cache in that dtype, so timings do not include it."""
    key_ = (cos_sin_cache.data_ptr(), cos_sin_cache._version, tuple(cos_sin_cache.shape), query.dtype)
    cache = _cache_in_dtype.get(key_)
    if cache is None:
        if len(_cache_in_dtype) > 8:
            _cache_in_dtype.clear()
        cache = _cache_in_dtype[key_] = cos_sin_cache.to(query.dtype)
    torch.ops.sgl_kernel.rotary_embedding.default(positions, query, key, head_size, cache, is_neox)
