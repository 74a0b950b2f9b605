"""autosel's own Triton kernels for the built-in ops (rmsnorm, fused_add_rmsnorm, silu/gelu_and_mul, rope, mm)."""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton
import triton.language as tl

from autosel.ops.common import next_power_of_2, pin_triton_cache_dir
# check_tensors (a value that is no tensor failed with AttributeError on `shape` or `dtype`) runs where the C
# launch has declined a call (it takes tensors only) or where a wrapper's first read of an argument failed, so a
# launched kernel's normal call pays nothing for it; mm, which has no C launch, checks on every call (about
# 0.1 us beside its Python and autotuner path).
from autosel.ops.torch_impl import check_tensors
from autosel.ops.triton_launch import FastLaunch, hooked

pin_triton_cache_dir()

# Autotuning benchmarks on a GPU driver, which Triton's CPU interpreter does not have; under the
# interpreter the matmul launches with one fixed config instead.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Rows longer than this many bytes no longer fit in registers in one pass; they are reduced in chunks.
_MAX_ROW_BYTES = 65536
# Chunk width for the two-pass path taken past _MAX_ROW_BYTES.
_CHUNK_COLS = 4096
# Short rows are packed several to a program until a tile holds about this many elements, so that
# per-head norms ([T * heads, 128]) do not launch one tiny program per row.
_TARGET_TILE = 2048


def _cdiv(a: int, b: int) -> int:
    """triton.cdiv for the host side of a launch: triton's is a ConstexprFunction, about 2 us a host call."""
    return -(-a // b)


def _num_warps(tile_elems: int, max_warps: int = 16, per_thread: int = 8) -> int:
    # per_thread elements per thread: 8 keeps 16-bit loads at 128 bits without spilling registers.
    return max(1, min(max_warps, tile_elems // (32 * per_thread)))


def _as_rows(t: torch.Tensor, width: int, *, name: str, in_place: bool) -> torch.Tensor:
    """View t as [rows, width] with unit column stride; in-place ops cannot accept a copy."""
    if t.shape[-1] != width:
        raise ValueError(f"{name} has last dim {t.shape[-1]}, but weight has {width} elements")
    if t.dim() == 2 and t.stride(1) == 1:
        return t
    try:
        rows = t.view(-1, width)
    except RuntimeError:
        rows = None
    if rows is not None and rows.stride(1) == 1:
        return rows
    if in_place:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
            f"[-1, {width}] with a contiguous last dim; pass such a tensor, the op writes through it"
        )
    return t.reshape(-1, width).contiguous()


# --------------------------------------------------------------------------------------------------
# RMSNorm, plain and with the residual add fused in front.


@triton.jit
def _load_rows(x_ptrs, res_ptrs, mask, ADD_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr):
    """x in fp32; with ADD_RESIDUAL, the fp32 sum x + residual, which STORE_RESIDUAL writes to the residual
    rounded to its dtype.

    The norm is taken of the fp32 sum, not of the rounded one, as flashinfer's (so sgl-kernel's) fused add + rmsnorm
    and the torch reference do: with x wider than the residual, or a sum beyond the residual dtype's range, the
    rounded sum differs by more than an ulp or is infinite (vLLM's kernel normalizes that; commit 996e828).
    """
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:
        x += tl.load(res_ptrs, mask=mask, other=0.0).to(tl.float32)
        if STORE_RESIDUAL:
            tl.store(res_ptrs, x.to(res_ptrs.dtype.element_ty), mask=mask)
    return x


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,
    n_rows, n_cols, x_stride, res_stride, out_stride, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    x_rows = x_ptr + rows[:, None] * x_stride
    res_rows = res_ptr + rows[:, None] * res_stride
    out_rows = out_ptr + rows[:, None] * out_stride
    cols = tl.arange(0, BLOCK_N)

    if ONE_PASS:
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        x = _load_rows(x_rows + cols[None, :], res_rows + cols[None, :], mask, ADD_RESIDUAL, True)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(out_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Rows too long for registers: the first pass only sums squares, the second adds again and writes both
        # outputs (one more read of x and the residual than storing the sum in the first pass and re-reading it,
        # which would normalize the rounded sum).
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < n_cols)
            x = _load_rows(x_rows + c[None, :], res_rows + c[None, :], mask, ADD_RESIDUAL, False)
            acc += x * x
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=1) / n_cols + eps)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            mask = row_mask[:, None] & (c[None, :] < n_cols)
            x = _load_rows(x_rows + c[None, :], res_rows + c[None, :], mask, ADD_RESIDUAL, True)
            w = tl.load(w_ptr + c, mask=c < n_cols, other=0.0).to(tl.float32)
            y = x * rstd[:, None] * w[None, :]
            tl.store(out_rows + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


_launch_rmsnorm_kernel = FastLaunch(_rmsnorm_kernel)
# Each kernel's whole launch in C, from its tensors (triton_launch.c's norm, act_and_mul and rope), where torch lets
# C read a tensor (its DLPack C exchange API): the wrapper's checks, views and plan cost the H200's host more than
# the launch itself (commit 996e828). It launches only what the Python path would launch, with the plans
# that path records (_remember), and returns False for everything else, which then takes the Python path. The C
# module is one for every FastLaunch; any launcher's answers whether it can launch here (not under the interpreter)
# and read tensors, so the first one's stands for all three kernels.
_DIRECT = _launch_rmsnorm_kernel.direct if _launch_rmsnorm_kernel.reads_dlpack else None
# Plans kept per kernel, as _rmsnorm_plan's cache: a bound for many token counts. When it is reached they all go, and
# each shape's next call takes the Python path once to plan again. Memos of pure functions of their keys, read with
# one dict lookup per call: never stale, so not autosel.state's to reset.
_PLANS_KEPT = 4096
_NORM_PLANS: dict[tuple, tuple] = {}  # (n_rows, n_cols, element size, fp16) -> _rmsnorm_plan(...)


def _remember(plans: dict, key: tuple, plan: tuple) -> None:
    """Record a plan the Python path launched with, for the C path's next call: call it only where _DIRECT is."""
    if len(plans) >= _PLANS_KEPT:
        plans.clear()
    plans[key] = plan


# A 16-bit row in a block of 8192 (hidden 4097-8192) takes 8 warps rather than 16: the plain norm from this many rows,
# fused add + rmsnorm at every row count but 1 and, in bf16 rows wider than _FUSED_16_WARPS_PAST, those in
# _FUSED_ROW_8192_16_WARPS.
_ROW_8192_8_WARPS_FROM = 2048
_FUSED_ROW_8192_16_WARPS = range(200, 300)
_FUSED_16_WARPS_PAST = 5120


@functools.lru_cache(maxsize=4096)
def _rmsnorm_plan(n_rows: int, n_cols: int, element_size: int, fp16: bool = False) -> tuple:
    """(grid, num_warps and constexprs without the residual add, num_warps and constexprs with it) for a [n_rows,
    n_cols] norm of `element_size`-byte elements (fp16: float16 rather than bfloat16): kept per shape, since working
    it out costs about a microsecond of host time a call."""
    max_cols = _MAX_ROW_BYTES // element_size
    block_n = next_power_of_2(n_cols)
    one_pass = block_n <= max_cols
    if not one_pass:
        block_n = _CHUNK_COLS
    block_m = min(max(1, _TARGET_TILE // block_n), next_power_of_2(n_rows))
    one_row = one_pass and block_m == 1
    # A program holding one whole row gets 32 bytes a thread (16 elements of 16 bits, 8 of fp32), not 16 bytes. At
    # 16 bytes (16 warps for a 16-bit block of 4096) it ran 1.1-1.4x behind 8 warps on the H200 from 600 tokens up at
    # hidden 2304 to 4096, and at most 5% ahead at 1-64 tokens (commit c0a755f). fp32 at
    # 16 elements a thread (4 warps for a block of 2048, 8 for 4096) ran 1.01-1.33x the time of twice the warps at 1-512
    # rows of hidden 2048 and 4096, 0.98-1.01x at 4096 rows (commit 2440375).
    per_thread = 16 if one_row and element_size <= 2 else 8
    plain_warps = fused_warps = _num_warps(block_m * block_n, per_thread=per_thread)
    if one_row and element_size == 2 and block_n == 8192:
        # 8 warps (32 elements a thread), not 16. bf16 graph replays on the H200 (commits 2440375 and ac2381e): the
        # plain norm at 0.97-0.99x the time of 16 warps at hidden 5120 and 6144 from 2048 rows, but
        # 0.99-1.04x at 300-2047 rows and 1.03-1.11x at 1-299; fused add + rmsnorm at 0.86-1.00x at 4-128 rows of
        # hidden 4480-8192, 0.80-1.00x at 300-2047 rows of 4480-6144 (0.87-1.03x at 7168 and 8192) and 0.91-0.92x at
        # 5120 from 2048 rows, but 1.06-1.14x at 1 row. At 200-299 rows bf16 turns with the width (commit ac2381e):
        # 0.93-0.99x at hidden 4480-5120, 0.95-1.05x at 5376-6144 and 1.01-1.09x at 7168-8192; fp16 does not:
        # 0.92-0.97x at 4480-7680 and 0.99-1.01x at 8192.
        if n_rows >= _ROW_8192_8_WARPS_FROM:
            plain_warps = 8
        if n_rows > 1 and (fp16 or not (n_rows in _FUSED_ROW_8192_16_WARPS and n_cols > _FUSED_16_WARPS_PAST)):
            fused_warps = 8
    elif one_row and element_size == 2 and block_n == 16384:
        # The plain norm at 32 warps (16 elements a thread again, past _num_warps' 16): 0.91-0.98x the time of 16 at
        # 1-1024 rows of hidden 10240-16384, 0.99-1.00x at 4096 rows; fused add + rmsnorm keeps 16: 32 ran 0.96-1.11x
        # its time from 16 rows (commit 2440375).
        plain_warps = 32
    # BLOCK_M, BLOCK_N, ONE_PASS, ADD_RESIDUAL
    return ((_cdiv(n_rows, block_m),), plain_warps, (block_m, block_n, one_pass, False),
            fused_warps, (block_m, block_n, one_pass, True))


def _launch_rmsnorm(x2, res2, weight, out, out_stride: int, eps: float) -> None:
    """out: any tensor whose rows start out_stride elements apart (a view of it would cost host time per call)."""
    n_rows, n_cols = x2.shape
    if weight.shape != (n_cols,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({n_cols},) to match x")
    if n_rows == 0:
        return
    weight = weight if weight.stride(0) == 1 else weight.contiguous()
    key = (n_rows, n_cols, x2.element_size(), x2.dtype == torch.float16)
    plan = _rmsnorm_plan(*key)
    if _DIRECT is not None:
        _remember(_NORM_PLANS, key, plan)
    grid, plain_warps, plain, fused_warps, with_residual = plan
    eps = float(eps)  # as the C path reads it, and as FastLaunch keys it (a numpy float would switch it off)
    if res2 is None:
        _launch_rmsnorm_kernel(grid, (x2, x2, weight, out, n_rows, n_cols, x2.stride(0), 0, out_stride, eps),
                               plain, plain_warps)
    else:
        x_stride, res_stride = x2.stride(0), res2.stride(0)
        if n_rows > 1 and (x_stride < n_cols or res_stride < n_cols):  # an expanded or overlapping view, in place
            raise _overlapping("x" if x_stride < n_cols else "residual", x2 if x_stride < n_cols else res2)
        _launch_rmsnorm_kernel(grid, (x2, res2, weight, out, n_rows, n_cols, x_stride, res_stride, out_stride, eps),
                               with_residual, fused_warps)


def _overlapping(name: str, rows: torch.Tensor) -> ValueError:
    """The in-place kernels' rows would race on shared memory: the torch backend refuses such a tensor too."""
    return ValueError(f"{name} with shape {tuple(rows.shape)} and strides {rows.stride()} has rows that overlap "
                      "(an expanded or overlapping view); the op writes through it: pass a tensor whose rows do not "
                      "share memory, e.g. .contiguous()")


def _not_1d(weight: torch.Tensor) -> ValueError:
    """For a 0-d weight, caught as the IndexError of weight.shape[-1]: a check before it would cost every call."""
    return ValueError(f"weight must be 1-D [hidden], got a {weight.dim()}-d tensor")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in fp32, returned in x.dtype."""
    # In x's own layout: 0.2-0.6 us less of the H200's host time than memory_format=torch.contiguous_format, and eager
    # rmsnorm at 1-990 tokens is host time (commit 4d8c8c8). A dense x in another order gives an out the C
    # path does not take (it launches on rows a width apart only); the Python path then makes a contiguous one.
    out = torch.empty_like(x)
    if _DIRECT is not None and not hooked() and _DIRECT.norm(
            _launch_rmsnorm_kernel.kept, _NORM_PLANS, x, None, weight, out, eps):
        return out
    check_tensors(weight=weight)  # x is one: empty_like took it
    try:
        width = weight.shape[-1]
    except IndexError:
        raise _not_1d(weight) from None
    x2 = _as_rows(x, width, name="x", in_place=False)
    if not out.is_contiguous():
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    # Contiguous, so its rows are a width apart; a 2-d out's own row stride is passed, as the C path reads it: one row
    # of a wider buffer is dense, and empty_like gave out that row's stride, which one row never steps by.
    _launch_rmsnorm(x2, None, weight, out, out.stride(0) if out.dim() == 2 else width, eps)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual (rounded to its dtype); x <- rmsnorm of the fp32 sum, weight, eps."""
    if _DIRECT is not None and not hooked() and _DIRECT.norm(
            _launch_rmsnorm_kernel.kept, _NORM_PLANS, x, residual, weight, x, eps):
        return
    if residual is None:
        raise ValueError("fused_add_rmsnorm needs a residual tensor the shape of x; without one, use layernorm.rmsnorm")
    check_tensors(x=x, residual=residual, weight=weight)
    if x.shape != residual.shape:
        raise ValueError(f"x has shape {tuple(x.shape)} but residual has {tuple(residual.shape)}")
    try:
        width = weight.shape[-1]
    except IndexError:
        raise _not_1d(weight) from None
    x2 = _as_rows(x, width, name="x", in_place=True)
    _launch_rmsnorm(x2, _as_rows(residual, width, name="residual", in_place=True), weight, x2, x2.stride(0), eps)


# --------------------------------------------------------------------------------------------------
# Gated activations: out = act(x[..., :D]) * x[..., D:].


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, n_out, x_stride, D: tl.constexpr, BLOCK: tl.constexpr, GELU: tl.constexpr,
                        WIDE: tl.constexpr):
    # The output's rows x D elements as one flat range, BLOCK of them a program whatever rows they fall in: no lane
    # idles where 128 does not divide D. D is a constant, so the row is a multiply and a shift, and where D is a
    # multiple of 8 (and x and its row stride are 16-byte aligned) the 16-bit loads and stores stay 16-byte vectors.
    if WIDE:  # offsets past int32
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_out
    rows = offs // D
    gate = x_ptr + rows.to(tl.int64) * x_stride + (offs - rows * D)
    a = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(gate + D, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        act = 0.5 * a * (1.0 + tl.math.erf(a * 0.7071067811865476))
    else:
        act = a / (1.0 + tl.exp(-a))  # one division: a * tl.sigmoid(a) ran up to 4% slower (commit 91c3466)
    tl.store(out_ptr + offs, (act * b).to(out_ptr.dtype.element_ty), mask=mask)


# gelu's programs take 2048 elements from this many output elements, 1024 below it (commit 754b853).
_GELU_BLOCK_2048_FROM = 6_000_000


@functools.lru_cache(maxsize=4096)
def _act_plan(n_rows: int, d: int, gelu: bool) -> tuple:
    """(num_warps, constexprs, 1, elements a program) for act_and_mul over [n_rows, 2 * d]: the kernel's grid is the
    output's n_rows * d elements over elements a program, rounded up, by 1. The layout is the C launch's (launch_rows:
    num_warps, constexprs, blocks on the second grid axis, count a program), which reads no constexpr.

    Graph replays on the H200 (commit 754b853; 64-12200 rows of 1344-14336 columns) put programs of 1024 elements
    (4 warps: 8 a thread, 16-byte loads of 16 bits) at 0.92-1.01x (geometric mean 0.97) the time of the plan before
    (a row or tiles of 8 x 128 a program, commit 91c3466); level with flashinfer at 1728 columns, where flashinfer had
    led by 6-8%. gelu from 7.9M elements ran 2-5% faster again in programs of 2048 (4 warps); from 4.0-4.8M level or
    5% slower, hence the threshold between. Past int32 the offsets are int64 (WIDE)."""
    n_out = n_rows * d
    block = 2048 if gelu and n_out >= _GELU_BLOCK_2048_FROM else 1024
    # D, BLOCK, GELU, WIDE (the last program's offsets reach n_out + block - 2)
    return 4, (d, block, gelu, n_out + block > 2**31), 1, block


_launch_act_and_mul = FastLaunch(_act_and_mul_kernel)
_ACT_PLANS: dict[tuple, tuple] = {}  # (n_rows, d, gelu) -> (num_warps, constexprs, 1, elements a program)


def _act_and_mul(x: torch.Tensor, *, gelu: bool) -> torch.Tensor:
    try:  # free unless it raises (Python 3.11's exception tables)
        width = x.shape[-1]
    except AttributeError:
        check_tensors(x=x)
        raise
    if width % 2:
        raise ValueError(f"x last dim must be even (gate and up halves), got {width}")
    d = width // 2
    out = x.new_empty((*x.shape[:-1], d))
    if _DIRECT is not None and not hooked() and _DIRECT.act_and_mul(_launch_act_and_mul.kept, _ACT_PLANS, x, out, gelu):
        return out
    x2 = _as_rows(x, width, name="x", in_place=False)
    n_rows = x2.shape[0]
    if n_rows == 0 or d == 0:
        return out
    num_warps, constexprs, _, block = plan = _act_plan(n_rows, d, gelu)
    if _DIRECT is not None:
        _remember(_ACT_PLANS, (n_rows, d, gelu), plan)
    # out is contiguous: its element i is row i // d, column i % d
    _launch_act_and_mul((_cdiv(n_rows * d, block), 1), (x2, out, n_rows * d, x2.stride(0)), constexprs, num_warps)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :D]) * x[..., D:] in fp32, returned in x.dtype with last dim D."""
    return _act_and_mul(x, gelu=False)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) gelu(x[..., :D]) * x[..., D:] in fp32, returned in x.dtype with last dim D."""
    return _act_and_mul(x, gelu=True)


# --------------------------------------------------------------------------------------------------
# Rotary position embedding, in place on query and key.


def _token_rows(t: torch.Tensor, n_tokens: int, *, name: str) -> torch.Tensor:
    """View t as [T, heads * head_size] without copying, since rope writes through it."""
    try:
        rows = t if t.dim() == 2 else t.view(n_tokens, -1)
    except RuntimeError:
        rows = None
    if rows is None or rows.shape[0] != n_tokens or rows.stride(1) != 1:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {t.stride()} cannot be viewed as "
            f"[{n_tokens}, heads * head_size] with contiguous heads ({n_tokens}: the length of positions, one per "
            "token)"
        )
    return rows


@triton.jit
def _rope_rotate(base_ptr, cos, sin, tokens, n_tokens, stride, heads, n_heads, r,
                 HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr, BLOCK_R: tl.constexpr):
    # A [tokens, heads, pairs] tile; cos and sin are [tokens, 1, pairs].
    head_ptr = base_ptr + tokens[:, None, None] * stride + heads[None, :, None] * HEAD_SIZE
    rows = (tokens[:, None, None] < n_tokens) & (heads[None, :, None] < n_heads)
    if IS_NEOX:
        mask = rows & (r[None, None, :] < HALF)
        p1 = head_ptr + r[None, None, :]
        p2 = p1 + HALF
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        tl.store(p1, (x1 * cos - x2 * sin).to(base_ptr.dtype.element_ty), mask=mask)
        tl.store(p2, (x2 * cos + x1 * sin).to(base_ptr.dtype.element_ty), mask=mask)
    else:
        # Pairs are interleaved: one contiguous load split in registers beats two stride-2 loads
        # (those ran ~6x slower on an H200).
        c = tl.arange(0, 2 * BLOCK_R)
        mask = rows & (c[None, None, :] < 2 * HALF)
        x = tl.load(head_ptr + c[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (x.shape[0], x.shape[1], BLOCK_R, 2)))
        y = tl.join(x1 * cos - x2 * sin, x2 * cos + x1 * sin)
        y = tl.reshape(y, (x.shape[0], x.shape[1], 2 * BLOCK_R))
        tl.store(head_ptr + c[None, None, :], y.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    n_tokens, n_q_heads, n_k_heads, q_stride, k_stride, cache_stride, n_positions, q_blocks,
    HEAD_SIZE: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
):
    # Grid: (token block, head block). The first q_blocks head blocks are the query's; with SPLIT_K the key's heads
    # have blocks of their own after them, else each query block also rotates the key heads of its indices.
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    block = tl.program_id(1)
    r = tl.arange(0, BLOCK_R)
    # One cos/sin row serves every head of its token. A position outside the cache is not read (the vendors'
    # kernels read past the cache; the torch backend raises, which a kernel cannot without synchronizing): its
    # token's query and key become NaN, so the mistake shows downstream.
    pos = tl.load(pos_ptr + tokens, mask=tokens < n_tokens, other=-1).to(tl.int64)
    # (r < HALF) & in range, written as one comparison: Triton's interpreter refuses a block mask and-ed with a scalar
    in_cache = r[None, :] < tl.where((pos >= 0) & (pos < n_positions), HALF, 0)[:, None]
    cache_rows = cache_ptr + pos[:, None] * cache_stride
    cos = tl.load(cache_rows + r[None, :], mask=in_cache, other=float("nan")).to(tl.float32)[:, None, :]
    sin = tl.load(cache_rows + HALF + r[None, :], mask=in_cache, other=float("nan")).to(tl.float32)[:, None, :]
    if block < q_blocks:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        _rope_rotate(q_ptr, cos, sin, tokens, n_tokens, q_stride, heads, n_q_heads, r, HEAD_SIZE, HALF, IS_NEOX,
                     BLOCK_R)
        if not SPLIT_K:
            _rope_rotate(k_ptr, cos, sin, tokens, n_tokens, k_stride, heads, n_k_heads, r, HEAD_SIZE, HALF, IS_NEOX,
                         BLOCK_R)
    else:
        heads = (block - q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        _rope_rotate(k_ptr, cos, sin, tokens, n_tokens, k_stride, heads, n_k_heads, r, HEAD_SIZE, HALF, IS_NEOX,
                     BLOCK_R)


# Rotated pairs a program: a head block holds up to this many, and where a token's heads hold fewer, a program takes
# as many tokens as fill it.
_ROPE_PAIRS = 512


@functools.lru_cache(maxsize=4096)
def _rope_plan(head_size: int, rotary_dim: int, n_q_heads: int, n_k_heads: int, is_neox: bool) -> tuple:
    """(num_warps, constexprs, head blocks, query blocks, tokens a program) for rope: up to 512 rotated pairs a
    program (8 heads of 128; one head where a head has more, at up to 4 heads, and where blocks of heads would leave
    some idle), 4 warps for them, the key's heads in blocks of their own once they fill one, and where a token's
    heads hold fewer than 512 pairs, as many tokens a program as fill it.

    Chosen on graph replays on the H200 (commits 547c865, 1d1ea1b, 91c3466 and 33914ad). 512 pairs a program beat the
    plan before (1024 pairs, the
    key's heads with the query's first block, 2 warps for 8 heads of 128): 0.81-1.01x its time up to 170 tokens,
    0.85-1.05x from 900 tokens on. At 8 query heads and 1 key head, key blocks of their own ran 1.4x slower at 13500
    tokens, so a key of fewer heads than a block rides with the query's. Filling a program with tokens: at 2 / 1
    heads 0.56x, 0.67x and 0.89x the time of one token a program at 15500, 4400 and 1750 tokens, at 4 / 1 heads 0.77x,
    0.85x and 0.91x; 1.02-1.08x at 1-360 tokens of 2 / 1 heads, where a launch's latency is most of the time.
    Programs of 1024 and 2048 pairs ran slower than 512 at most head and token counts. One head a block (and 8
    tokens of 128-wide heads) for head counts that leave a block part idle: at 3, 5, 6, 7, 10, 12 and
    20 query heads 0.74-0.97x the time of the plan before up to 64 tokens, 0.79-1.07x from 500 tokens on; 5 / 1 heads
    at 14000 tokens 0.79x, where flashinfer ran 0.82x; and for 2 and 4 heads, 0.73-0.82x the plan before up
    to 500 tokens, where flashinfer ran 0.82-0.92x, and 0.92-0.98x from 2000 on). At 8 heads and more that blocks
    fill, it ran 0.86-1.05x up to 64 tokens and 0.98-1.12x from 2000 (8 / 1, 8 / 2, 16 / 2, 32 / 8, 64 / 8), so those
    keep their blocks; 24, 40 and 48 heads, which no probe timed, fill blocks of 8 and keep them too."""
    block_r = next_power_of_2(rotary_dim // 2)
    heads = max(n_q_heads, n_k_heads, 1)
    full = min(next_power_of_2(heads), max(1, _ROPE_PAIRS // block_r))  # the block of heads the plan gave before
    # One head a block where those blocks would leave heads idle (5 heads in a block of 8; 40 heads fill 5 blocks),
    # and at up to 4 heads, where a program of one head and 8 tokens ran faster than one of all the heads.
    block_h = 1 if heads % full != 0 or heads <= 4 else full
    block_t = max(1, _ROPE_PAIRS // (block_h * block_r))
    split_k = n_k_heads >= block_h
    q_blocks = _cdiv(n_q_heads if split_k else max(n_q_heads, n_k_heads), block_h)
    head_blocks = q_blocks + _cdiv(n_k_heads, block_h) if split_k else q_blocks
    constexprs = (head_size, rotary_dim // 2, bool(is_neox), block_t, block_h, block_r, split_k)
    return _num_warps(2 * block_t * block_h * block_r, max_warps=8), constexprs, head_blocks, q_blocks, block_t


_launch_rope = FastLaunch(_rope_kernel)
# (head_size, rotary_dim, q heads, k heads, is_neox) -> _rope_plan(...)
_ROPE_PLANS: dict[tuple, tuple] = {}


def rope(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    """In place on query [T, Hq*head_size] and key [T, Hk*head_size]; cache rows are [cos | sin]. A token whose
    position is not a row of the cache gets NaN in the rotated part of its query and key."""
    if _DIRECT is not None and not hooked() and _DIRECT.rope(
            _launch_rope.kept, _ROPE_PLANS, positions, query, key, head_size, cos_sin_cache, is_neox):
        return
    check_tensors(positions=positions, query=query, key=key, cos_sin_cache=cos_sin_cache)
    if cos_sin_cache.dim() != 2:  # a row per position is what the kernel indexes
        raise ValueError(f"cos_sin_cache must be 2-D [positions, rotary_dim], got shape {tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(f"cos_sin_cache last dim {rotary_dim} must be even and <= head_size {head_size}")
    if positions.dtype not in (torch.int64, torch.int32):  # a float index was truncated, silently
        raise ValueError(f"positions must be int64 or int32, got {positions.dtype}")
    if cos_sin_cache.stride(-1) != 1:  # the kernel steps through a row one element at a time
        cos_sin_cache = cos_sin_cache.contiguous()
    n_tokens = positions.numel()
    q2 = _token_rows(query, n_tokens, name="query")
    k2 = _token_rows(key, n_tokens, name="key")
    if q2.shape[1] % head_size or k2.shape[1] % head_size:
        raise ValueError(
            f"query width {q2.shape[1]} and key width {k2.shape[1]} must be multiples of head_size {head_size}"
        )
    if n_tokens == 0:
        return
    if n_tokens > 1 and (q2.stride(0) < q2.shape[1] or k2.stride(0) < k2.shape[1]):
        raise _overlapping("query" if q2.stride(0) < q2.shape[1] else "key", q2 if q2.stride(0) < q2.shape[1] else k2)
    n_q_heads, n_k_heads = q2.shape[1] // head_size, k2.shape[1] // head_size
    plan_key = (head_size, rotary_dim, n_q_heads, n_k_heads, bool(is_neox))
    num_warps, constexprs, head_blocks, q_blocks, block_t = plan = _rope_plan(*plan_key)
    if _DIRECT is not None:
        _remember(_ROPE_PLANS, plan_key, plan)
    _launch_rope(
        (_cdiv(n_tokens, block_t), head_blocks),
        (positions.contiguous(), q2, k2, cos_sin_cache, n_tokens, n_q_heads, n_k_heads, q2.stride(0), k2.stride(0),
         cos_sin_cache.stride(0), cos_sin_cache.shape[0], q_blocks),
        constexprs, num_warps,
    )


# --------------------------------------------------------------------------------------------------
# Matmul against an nn.Linear weight: a [M, K] @ b[N, K].T.


@triton.jit
def _mm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):
    # Grouped ordering: GROUP_M row-blocks walk the column-blocks together, so the b tiles they share
    # are still in L2 when the next row-block asks for them.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Wrapping out-of-range rows/cols (instead of masking) keeps the inner-loop loads unmasked in M/N;
    # the wrapped results are dropped by the store mask.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None] * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        if DOT_IN_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@functools.cache  # one object per config, however many token ranges try it
def _mm_config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": 8},
        num_warps=num_warps, num_stages=num_stages,
    )


# Chosen from sweeps on an H200 (bf16), per token count, since the autotuner times every config it is given at
# every new (M, N, K): 256x128 tiles for prefill-sized M; for decode, tiles as tall as M with 32 or 64 columns and
# long K steps, so that at 17-64 tokens about one program per SM reads its slice of the weight once (16-row tiles
# read it twice from 17 tokens on: 0.99-1.35x cuBLAS's time at 17-32 tokens of Llama-3-8B's weights became
# 0.88-1.12x; commit f981d83). In fp32 the largest tiles overflow shared memory; the
# autotuner times such configs as infinitely slow, and the smaller ones fit.
_MM_CONFIGS_BY_ROWS = (  # (up to this many rows, the configs tried)
    (16, (_mm_config(16, 64, 256, 4, 3), _mm_config(16, 32, 256, 4, 4), _mm_config(16, 32, 256, 2, 4))),
    (32, (_mm_config(32, 32, 256, 4, 4), _mm_config(32, 32, 128, 4, 4), _mm_config(16, 32, 256, 2, 4),
          _mm_config(32, 64, 128, 4, 4))),
    (64, (_mm_config(64, 32, 128, 4, 4), _mm_config(64, 32, 256, 4, 3), _mm_config(16, 32, 256, 2, 4),
          _mm_config(128, 128, 64, 4, 4))),
    (None, (_mm_config(256, 128, 64, 8, 3), _mm_config(128, 128, 64, 4, 4), _mm_config(64, 64, 64, 4, 4),
            _mm_config(64, 32, 128, 4, 4))),
)
_MM_CONFIGS = list(dict.fromkeys(c for _, configs in _MM_CONFIGS_BY_ROWS for c in configs))


def _mm_configs_for(configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's configs for a call of named_args["M"] rows (triton.autotune's early_config_prune)."""
    rows = named_args["M"]
    chosen = next(c for most, c in _MM_CONFIGS_BY_ROWS if most is None or rows <= most)
    return [c for c in configs if c in chosen]


# Small tiles under the interpreter so tiny test shapes still cross several blocks and K steps.
_MM_INTERPRET_META = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}


def _short_autotune(configs: list, key: list[str], prune=None):
    """triton.autotune with shorter benchmarks per config (5 ms warm-up, 20 ms, not 25 and 100) and, where this
    Triton has it, its choice per key cached on disk: an autosel tune calls the mm at ten new shapes, and the
    default autotuning took 11 s of a warm whole-library tune on the H200 (commit 07299d6). `prune`: its
    early_config_prune, the configs worth timing for a call."""
    options = inspect.signature(triton.autotune).parameters
    extra = {"prune_configs_by": {"early_config_prune": prune}} if prune else {}
    if "do_bench" in options:
        extra["do_bench"] = lambda fn, quantiles: triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)
    if "cache_results" in options:
        extra["cache_results"] = True
    return triton.autotune(configs=configs, key=key, **extra)


_mm_tuned = _mm_kernel if _INTERPRET else _short_autotune(_MM_CONFIGS, ["M", "N", "K"], _mm_configs_for)(_mm_kernel)


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T for a [M, K] and an nn.Linear weight b [N, K], fp32 accumulation, returned in a.dtype."""
    check_tensors(a=a, b=b)
    if a.dtype != b.dtype:
        raise ValueError(f"a is {a.dtype} but b is {b.dtype}; cast one so both match")
    if b.dim() != 2 or a.shape[-1] != b.shape[1]:
        raise ValueError(f"a {tuple(a.shape)} @ b.T needs b as [N, {a.shape[-1]}], got {tuple(b.shape)}")
    a2 = a if a.dim() == 2 else a.reshape(-1, a.shape[-1])
    (m, k), n = a2.shape, b.shape[0]
    out = torch.empty((*a.shape[:-1], n), dtype=a.dtype, device=a.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    c2 = out.view(m, n)
    # torch keeps fp32 matmuls in full precision by default; tf32 would fail the fp32 tolerance. (input_precision
    # applies to fp32 operands only: 16-bit ones multiply as they are whatever it says.)
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    # The interpreter stores bf16 as uint16 and its tl.dot multiplies those raw bits as integers.
    dot_in_fp32 = _INTERPRET and a.dtype == torch.bfloat16
    args = (a2, b, c2, m, n, k, a2.stride(0), a2.stride(1), b.stride(0), b.stride(1), c2.stride(0), c2.stride(1))
    if _INTERPRET:
        meta = _MM_INTERPRET_META
        grid = (_cdiv(m, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"]),)
        _mm_tuned[grid](*args, DOT_PRECISION=precision, DOT_IN_FP32=dot_in_fp32, **meta)
    else:
        def grid(meta):
            return (_cdiv(m, meta["BLOCK_M"]) * _cdiv(n, meta["BLOCK_N"]),)

        _mm_tuned[grid](*args, DOT_PRECISION=precision, DOT_IN_FP32=False)
    return out
