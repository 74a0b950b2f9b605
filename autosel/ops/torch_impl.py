"""Pure-torch implementations of the built-in ops: the torch backend and every op's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def check_tensors(**named) -> None:
    """A TypeError naming the first value that is no tensor (a list or a number failed with "'list' object has no
    attribute 'is_floating_point'", or 'shape'); autosel's Triton wrappers call it too."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} is a {type(value).__name__}; the op takes torch tensors")


def _check_float(name: str, x: torch.Tensor) -> None:
    # An integer tensor came back truncated (an rmsnorm of int32 rows as zeros and ones), with no error.
    check_tensors(**{name: x})
    if not x.is_floating_point():
        raise ValueError(f"{name} is {x.dtype}; the op takes floating-point tensors (bfloat16, float16, float32)")


def _check_weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    # A weight of one element broadcast silently here, where the other backends raise.
    check_tensors(weight=weight)
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({x.shape[-1]},) to match x's last dim")


def _halves(x: torch.Tensor) -> int:
    # An odd width broadcast [T, 1] against [T, 2] into a wrong result of the wrong shape.
    if x.shape[-1] % 2:
        raise ValueError(f"x has last dim {x.shape[-1]}: a gated activation takes [gate | up], an even width")
    return x.shape[-1] // 2


def check_residual(x: torch.Tensor, residual: torch.Tensor) -> None:
    # A residual of another shape broadcast into x + residual, or failed inside torch.compile's tracing with a
    # message about fake tensors; the Triton kernel's words.
    check_tensors(x=x, residual=residual)
    if residual.shape != x.shape:
        raise ValueError(f"x has shape {tuple(x.shape)} but residual has {tuple(residual.shape)}")


def _check_heads(query: torch.Tensor, key: torch.Tensor, head_size: int) -> None:
    # A width that head_size does not divide failed in view(), under torch.compile inside its tracing.
    if query.shape[-1] % head_size or key.shape[-1] % head_size:
        raise ValueError(f"query width {query.shape[-1]} and key width {key.shape[-1]} must be multiples of "
                         f"head_size {head_size}")


def _check_rows(name: str, x: torch.Tensor, signature: str) -> None:
    # x[2, 4, 64] and a 1-D x were accepted here although the signature says x[T, H]; the vendors' kernels that
    # selection picks on a GPU take 2-D rows only, so a call that ran on a CPU failed on another machine.
    if x.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; the op takes {signature}, 2-D: "
                         f"reshape it to (-1, {x.shape[-1] if x.dim() else 1}) first")


def _check_cache(positions: torch.Tensor, cos_sin_cache: torch.Tensor, head_size: int) -> None:
    # Float positions and a cache wider than head_size failed inside torch.compile's tracing (34 lines about fake
    # tensors), or were truncated silently; the Triton kernel's words.
    if positions.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"positions must be int64 or int32, got {positions.dtype}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache must be 2-D [positions, rotary_dim], got shape {tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"cos_sin_cache last dim {rotary_dim} must be even and <= head_size {head_size}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_float("x", x)
    _check_rows("x", x, "x[T, H]")
    _check_weight(x, weight)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def check_fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """The arguments of fused_add_rmsnorm, checked where the torch_compile backend checks them too: outside its
    graph, whose tracing turned every mismatch into a message about fake tensors."""
    check_residual(x, residual)
    _check_float("x", x)
    _check_rows("x", x, "x[T, H]")
    _check_weight(x, weight)


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, as flashinfer and sgl-kernel do it: residual <- x + residual; x <- rmsnorm(residual)."""
    check_fused_add_rmsnorm(x, residual, weight)
    summed = x.float() + residual.float()
    residual.copy_(summed)
    x.copy_(summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * weight.float())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    _check_float("x", x)
    _check_rows("x", x, "x[T, 2I]")
    d = _halves(x)
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    _check_float("x", x)
    _check_rows("x", x, "x[T, 2I]")
    d = _halves(x)
    return (F.gelu(x[..., :d].float(), approximate="none") * x[..., d:].float()).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool) -> None:
    rotary_dim = cos.shape[-1] * 2
    heads = x.view(x.shape[0], -1, head_size)
    rot = heads[..., :rotary_dim].float()
    cos, sin = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    heads[..., :rotary_dim] = out.to(x.dtype)


def rope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
         cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
    """Rotary embedding in place on query and key; cos_sin_cache rows are [cos | sin] (vLLM/flashinfer layout).
    Positions index the cache unchecked on the device (a check would wait for the GPU): torch raises an IndexError
    for one past its rows, torch.compile's CPU code a RuntimeError, or aborts the process where the index is read
    inside its parallel loop (2 tokens of 8 rows: "terminate called ...", exit code 134), and the GPU kernels read
    out of bounds."""
    _check_float("query", query)
    _check_float("key", key)
    _check_heads(query, key, head_size)
    check_tensors(positions=positions, cos_sin_cache=cos_sin_cache)
    _check_cache(positions, cos_sin_cache, head_size)
    if positions.numel() == 0:  # an idle rank's empty batch: view(0, -1, head_size) cannot infer its -1
        return
    cos, sin = cos_sin_cache.index_select(0, positions).float().chunk(2, dim=-1)
    _rotate(query, cos, sin, head_size, is_neox)
    _rotate(key, cos, sin, head_size, is_neox)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T with b in nn.Linear's [out_features, in_features] layout."""
    return F.linear(a, b)
