"""Tests for autosel.ops.triton_kernels against plain-torch references, under Triton's CPU interpreter when there is no GPU."""

from __future__ import annotations

import math

import pytest
import torch

from triton_interpret import DEVICE, import_kernels, interpreter_env  # noqa: F401 - the fixture is autouse

_INTERPRET = DEVICE == "cpu"
tk = import_kernels("autosel.ops.triton_kernels")


DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (rtol, atol) per dtype: about one or two ulps of the output dtype.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (1e-2, 1e-2)}
EPS = 1e-6


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, equal_nan=False)


def randn(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, dtype=torch.float32) * scale).to(dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------------
# Plain-torch references.


def ref_rmsnorm(x, weight, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def ref_fused_add_rmsnorm(x, residual, weight, eps):
    """As flashinfer's kernel and autosel's torch backend: the norm is of the fp32 sum, not of the stored one."""
    summed = x.float() + residual.float()
    out = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype), summed.to(residual.dtype)


def ref_silu_and_mul(x):
    a, b = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(a) * b).to(x.dtype)


def ref_gelu_and_mul(x):
    a, b = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.gelu(a, approximate="none") * b).to(x.dtype)


def ref_rope(positions, query, key, head_size, cos_sin_cache, is_neox):
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    cos, sin = cos_sin_cache[positions].float()[:, None, :].split(half, dim=-1)

    def rotate(t):
        heads = t.float().reshape(t.shape[0], -1, head_size)
        rot, rest = heads[..., :rotary_dim], heads[..., rotary_dim:]
        x1, x2 = (rot[..., :half], rot[..., half:]) if is_neox else (rot[..., 0::2], rot[..., 1::2])
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        rot = torch.cat([o1, o2], dim=-1) if is_neox else torch.stack([o1, o2], dim=-1).flatten(-2)
        return torch.cat([rot, rest], dim=-1).reshape(t.shape).to(t.dtype)

    return rotate(query), rotate(key)


def ref_mm(a, b):
    return (a.float() @ b.float().T).to(a.dtype)


# --------------------------------------------------------------------------------------------------
# Checks shared with tests/gpu/test_triton_kernels_gpu.py, which runs them at bigger shapes.


def check_rmsnorm(shape, dtype, device):
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    weight = randn(shape[-1], dtype=dtype, device=device)
    x_before = x.clone()
    out = tk.rmsnorm(x, weight, EPS)
    assert out.device == x.device
    assert_close(out, ref_rmsnorm(x_before, weight, EPS), dtype)
    assert torch.equal(x, x_before)


def check_fused_add_rmsnorm(shape, dtype, device):
    x = randn(*shape, dtype=dtype, device=device)
    residual = randn(*shape, dtype=dtype, device=device, scale=2.0)
    weight = randn(shape[-1], dtype=dtype, device=device)
    expected_x, expected_residual = ref_fused_add_rmsnorm(x, residual, weight, EPS)
    assert tk.fused_add_rmsnorm(x, residual, weight, EPS) is None
    if _INTERPRET and dtype == torch.bfloat16:
        # The interpreter truncates fp32 -> bf16 where GPUs round to nearest even: one ulp apart at most.
        assert_close(residual, expected_residual, dtype)
    else:
        # Both sides round the same fp32 sum to the same dtype, so the residual must match bit for bit.
        torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close(x, expected_x, dtype)


def check_act_and_mul(fn, ref, shape, dtype, device):
    x = randn(*shape, dtype=dtype, device=device, scale=2.0)
    out = fn(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, ref(x), dtype)


def check_rope(*, n_tokens, n_q_heads, n_kv_heads, head_size, rotary_dim, is_neox, dtype, device, max_pos=64):
    positions = torch.randint(0, max_pos, (n_tokens,), dtype=torch.int64).to(device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
    query = randn(n_tokens, n_q_heads * head_size, dtype=dtype, device=device)
    key = randn(n_tokens, n_kv_heads * head_size, dtype=dtype, device=device)
    expected_q, expected_k = ref_rope(positions, query, key, head_size, cos_sin_cache, is_neox)
    assert tk.rope(positions, query, key, head_size, cos_sin_cache, is_neox) is None
    assert_close(query, expected_q, dtype)
    assert_close(key, expected_k, dtype)


def check_mm(m, n, k, dtype, device):
    # Scaling by K^-1/4 keeps outputs near unit size, so one tolerance fits every K.
    a = randn(m, k, dtype=dtype, device=device, scale=k**-0.25)
    b = randn(n, k, dtype=dtype, device=device, scale=k**-0.25)
    assert_close(tk.mm(a, b), ref_mm(a, b), dtype)


# --------------------------------------------------------------------------------------------------
# Tiny, non-power-of-two shapes: the interpreter runs every program in numpy.


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (5, 96), (3, 200), (2, 3, 40)])
def test_rmsnorm(shape, dtype):
    check_rmsnorm(shape, dtype, DEVICE)


def test_rmsnorm_of_a_dense_transposed_x_returns_contiguous_rows():
    # out is allocated in x's layout (cheaper on the host); a dense x in another order must still get contiguous
    # rows, the layout the kernel writes and the traced op's fake output promises
    x = randn(3, 2, 40, dtype=torch.bfloat16, device=DEVICE).transpose(0, 1)
    weight = randn(40, dtype=torch.bfloat16, device=DEVICE)
    out = tk.rmsnorm(x, weight, EPS)
    assert out.is_contiguous() and out.shape == x.shape
    assert_close(out, ref_rmsnorm(x, weight, EPS), torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (5, 96), (3, 200), (2, 3, 40)])
def test_fused_add_rmsnorm(shape, dtype):
    check_fused_add_rmsnorm(shape, dtype, DEVICE)


@pytest.fixture
def two_pass(monkeypatch):
    """The chunked path only starts past 16K columns, too slow to interpret: shrink its thresholds instead, with no
    plan of the real thresholds kept from an earlier test (the plan caches) and none of these kept for later ones."""
    monkeypatch.setattr(tk, "_MAX_ROW_BYTES", 64)
    monkeypatch.setattr(tk, "_CHUNK_COLS", 16)
    monkeypatch.setattr(tk, "_NORM_PLANS", {})
    tk._rmsnorm_plan.cache_clear()
    yield
    tk._rmsnorm_plan.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_two_pass_path(two_pass, fused, dtype):
    assert tk._rmsnorm_plan(3, 50, torch.tensor([], dtype=dtype).element_size())[4][2] is False  # ONE_PASS off
    check = check_fused_add_rmsnorm if fused else check_rmsnorm
    check((3, 50), dtype, DEVICE)


@pytest.mark.parametrize("n_rows, n_cols, element_size, plain_warps, fused_warps", [
    # a 16-bit row in a block of 8192: 8 warps from 2048 rows; fused add + rmsnorm at every count but 1 and, past
    # hidden 5120, 200-299
    (1, 5120, 2, 16, 16), (2, 5120, 2, 16, 8), (199, 8192, 2, 16, 8), (200, 4480, 2, 16, 8),
    (299, 5120, 2, 16, 8), (200, 5121, 2, 16, 16), (299, 8192, 2, 16, 16), (300, 5121, 2, 16, 8),
    (300, 5120, 2, 16, 8), (2047, 5120, 2, 16, 8), (2048, 5120, 2, 8, 8),
    (16384, 8192, 2, 8, 8), (2048, 4097, 2, 8, 8), (300, 8192, 2, 16, 8),  # the block's first and last widths
    # a 16-bit row in a block of 16384: the plain norm 32 warps, fused add + rmsnorm 16
    (1, 16384, 2, 32, 16), (2048, 9000, 2, 32, 16),
    # 32 bytes a thread: 16-bit blocks of 4096 and fp32 ones of 2048 and 4096 (8 and 16 warps); fp32 in a block of
    # 8192 stays at _num_warps' 16
    (2048, 4096, 2, 8, 8), (64, 2048, 4, 8, 8), (64, 4096, 4, 16, 16), (2048, 5120, 4, 16, 16),
])
def test_rmsnorm_plan_warps(n_rows, n_cols, element_size, plain_warps, fused_warps):
    grid, warps, plain, warps_fused, fused = tk._rmsnorm_plan(n_rows, n_cols, element_size)
    assert (warps, warps_fused) == (plain_warps, fused_warps)
    assert plain[:3] == fused[:3] and plain[2] is True and (plain[3], fused[3]) == (False, True)  # one pass
    assert grid == (n_rows,) and plain[0] == 1  # one row a program


@pytest.mark.parametrize("n_rows, n_cols", [(200, 5121), (256, 7168), (299, 8192)])
def test_float16_fused_rows_past_hidden_5120_take_8_warps_where_bfloat16_takes_16(n_rows, n_cols):
    assert tk._rmsnorm_plan(n_rows, n_cols, 2)[3] == 16
    assert tk._rmsnorm_plan(n_rows, n_cols, 2, True)[3] == 8
    assert tk._rmsnorm_plan(n_rows, n_cols, 2, True)[1] == tk._rmsnorm_plan(n_rows, n_cols, 2)[1]  # the plain norm's


@pytest.mark.parametrize("one_pass", [True, False], ids=["one_pass", "two_pass"])
def test_fused_add_rmsnorm_normalizes_the_fp32_sum_where_the_stored_one_overflows(request, one_pass):
    # 40000 + 40000 is past fp16's 65504: the stored residual is inf, as everywhere; the norm of the fp32 sum is
    # finite, as flashinfer's and the torch backend's are. Normalizing the stored sum made the whole row NaN.
    if not one_pass:
        request.getfixturevalue("two_pass")
    assert tk._rmsnorm_plan(2, 50, 2)[4][2] is one_pass  # ONE_PASS as the test's name says
    x = torch.full((2, 50), 40000.0, dtype=torch.float16, device=DEVICE)
    x[:, 1::2] = 1.0
    residual, weight = x.clone(), torch.ones(50, dtype=torch.float16, device=DEVICE)
    expected_x, expected_residual = ref_fused_add_rmsnorm(x, residual, weight, EPS)
    tk.fused_add_rmsnorm(x, residual, weight, EPS)
    assert torch.isinf(residual[:, 0::2]).all() and torch.isfinite(expected_x).all()
    torch.testing.assert_close(residual, expected_residual, rtol=0, atol=0)
    assert_close(x, expected_x, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (7, 80), (3, 2200), (2, 3, 48)])
@pytest.mark.parametrize("fn, ref", [(tk.silu_and_mul, ref_silu_and_mul), (tk.gelu_and_mul, ref_gelu_and_mul)],
                         ids=["silu", "gelu"])
def test_act_and_mul(fn, ref, shape, dtype):
    check_act_and_mul(fn, ref, shape, dtype, DEVICE)


@pytest.mark.parametrize("fn, ref", [(tk.silu_and_mul, ref_silu_and_mul), (tk.gelu_and_mul, ref_gelu_and_mul)],
                         ids=["silu", "gelu"])
@pytest.mark.parametrize("shape", [(515, 272), (3, 2, 2 * 1000)], ids=["d136", "d1000-3d"])
def test_act_and_mul_programs_take_elements_across_rows(fn, ref, shape):
    # 515 x 136 = 70040 output elements: 69 programs of 1024, most of them spanning a row boundary, the last holding
    # 408; d = 1000 puts row boundaries mid-program at offsets no power of two above 8 divides
    n_rows, d = math.prod(shape[:-1]), shape[-1] // 2
    num_warps, (width, block, gelu, wide), grid_y, per = tk._act_plan(n_rows, d, fn is tk.gelu_and_mul)
    assert (width, block, wide, grid_y, per) == (d, 1024, False, 1, 1024)
    check_act_and_mul(fn, ref, shape, torch.float16, DEVICE)


@pytest.mark.parametrize("n_rows, d, gelu, block, wide", [
    (1, 1728, False, 1024, False), (12200, 1728, False, 1024, False),
    (2300, 2608, True, 1024, False), (2300, 2609, True, 2048, False),  # gelu: 2048 from 6M output elements
    (12200, 14336, True, 2048, False), (12200, 14336, False, 1024, False),
    (2**31 // 4096 - 1, 4096, False, 1024, False), (2**31 // 4096, 4096, False, 1024, True),  # int64 offsets
    (2**31 // 4096, 4096, True, 2048, True), (2**21 - 1, 1024, False, 1024, False),  # n_out + block == 2^31: int32
])
def test_act_plan(n_rows, d, gelu, block, wide):
    num_warps, constexprs, grid_y, per = tk._act_plan(n_rows, d, gelu)
    assert constexprs == (d, block, gelu, wide) and (grid_y, per) == (1, block)  # D, BLOCK, GELU, WIDE
    assert num_warps == 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "n_q_heads, n_kv_heads, head_size, rotary_dim",
    # (2, 1, 128, 128): 8 tokens a program, so 5 tokens leave the program 3 masked out
    [(4, 2, 16, 16), (3, 1, 24, 8), (2, 2, 12, 12), (5, 3, 20, 12), (20, 12, 128, 128), (2, 1, 128, 128)],
)
def test_rope(n_q_heads, n_kv_heads, head_size, rotary_dim, is_neox, dtype):
    check_rope(n_tokens=5, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, head_size=head_size,
               rotary_dim=rotary_dim, is_neox=is_neox, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("q_heads, k_heads, head_size, rotary_dim, blocks", [
    (128, 8, 128, 128, (17, 16)),  # Llama-3.1-405B: 16 query blocks of 8 heads, the key's 8 heads a block of its own
    (64, 16, 128, 128, (10, 8)),
    (32, 8, 128, 128, (5, 4)),
    (8, 1, 128, 128, (1, 1)),  # a one-head key rides with the query's block (blocks of their own ran 1.4x slower)
    (16, 12, 128, 128, (4, 2)),  # a key block of 4 heads masked out of 8
    (20, 12, 128, 128, (32, 20)),  # 20 heads leave a block of 8 part idle: one head a block, 8 tokens a program
    (5, 1, 128, 128, (6, 5)),
    (40, 8, 128, 128, (6, 5)),  # 40 heads fill 5 blocks of 8: they keep them
    (24, 8, 128, 128, (4, 3)),
    (6, 6, 256, 256, (12, 6)),  # one head of 128 pairs a block: 4 tokens a program
    (32, 2, 128, 64, (2, 2)),  # GLM-4: 64 rotated dims, 16 heads of 32 pairs a block
    (2, 1, 2048, 2048, (3, 2)),  # 1024 pairs a head: one head a block, so the key's one head fills one
    (2, 1, 128, 128, (3, 2)),  # up to 4 heads: one head of 64 pairs a block, 8 tokens a program
    (4, 4, 128, 128, (8, 4)),
])
def test_rope_plan_gives_the_key_blocks_of_its_own_once_it_fills_one(q_heads, k_heads, head_size, rotary_dim, blocks):
    num_warps, constexprs, head_blocks, q_blocks, block_t = tk._rope_plan(head_size, rotary_dim, q_heads, k_heads,
                                                                         True)
    block_t_, block_h, block_r, split_k = constexprs[3:]
    assert (head_blocks, q_blocks) == blocks and split_k == (k_heads >= block_h) and block_t == block_t_
    assert block_h * block_r <= 512 or block_h == 1
    # where a token's heads hold fewer than 512 pairs, a program takes tokens until it holds exactly 512
    assert block_t * block_h * block_r == 512 if block_h * block_r < 512 else block_t == 1
    assert num_warps == min(8, max(1, 2 * block_t * block_h * block_r // 256))
    # every head of the query and the key is in exactly one block
    k_blocks = range(q_blocks, head_blocks) if split_k else range(q_blocks)
    assert q_blocks * block_h >= q_heads and len(k_blocks) * block_h >= k_heads


def test_rope_plan_is_worked_out_once_per_shape():
    # It was worked out again on every call that took the Python path (the C path off: a torch without the DLPack C
    # exchange API, or a profiler's launch hook), as the norm and gated plans were not.
    assert tk._rope_plan(128, 128, 5, 1, True) is tk._rope_plan(128, 128, 5, 1, True)


def test_rope_reads_a_cos_sin_cache_whose_rows_are_not_contiguous():
    # Only the row stride reached the kernel, which stepped through a row one element at a time: a cache laid out
    # column-major gave wrong results (max error 5.5), silently.
    positions = torch.tensor([0, 3, 1], dtype=torch.int64, device=DEVICE)
    cos_sin_cache = torch.randn(8, 4, dtype=torch.float32, device=DEVICE).T  # [4, 8], strides (1, 4)
    query, key = torch.randn(3, 16, device=DEVICE), torch.randn(3, 8, device=DEVICE)
    expected_q, expected_k = ref_rope(positions, query, key, 8, cos_sin_cache, True)
    tk.rope(positions, query, key, 8, cos_sin_cache, True)
    assert_close(query, expected_q, torch.float32)
    assert_close(key, expected_k, torch.float32)


def test_rope_leaves_nan_for_a_position_outside_the_cache_instead_of_reading_past_it():
    # The kernel read the row at any position (the vendors' do too): past the cache, another buffer's bytes or an
    # illegal address. Now such a token's query and key are NaN and the others are rotated as before.
    positions = torch.tensor([0, 4, 1, -1], dtype=torch.int64, device=DEVICE)
    cos_sin_cache = torch.randn(4, 8, dtype=torch.float32, device=DEVICE)
    query, key = torch.randn(4, 16, device=DEVICE), torch.randn(4, 8, device=DEVICE)
    in_cache = torch.tensor([0, 2])
    expected_q, expected_k = ref_rope(positions[in_cache], query[in_cache], key[in_cache], 8, cos_sin_cache, True)
    tk.rope(positions, query, key, 8, cos_sin_cache, True)
    assert torch.isnan(query[[1, 3]]).all() and torch.isnan(key[[1, 3]]).all()
    assert_close(query[in_cache], expected_q, torch.float32)
    assert_close(key[in_cache], expected_k, torch.float32)


def test_rope_refuses_a_cos_sin_cache_that_is_not_2d():
    # The kernel indexes a row per position: a [1, positions, rotary_dim] cache was read as one row (every position
    # past 0 NaN), a 1-D one as rows of whatever memory followed.
    positions = torch.tensor([0, 1], dtype=torch.int64, device=DEVICE)
    query, key = torch.randn(2, 16, device=DEVICE), torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="cos_sin_cache must be 2-D"):
        tk.rope(positions, query, key, 8, torch.randn(1, 4, 8, device=DEVICE), True)


def test_rope_accepts_3d_query_and_key():
    positions = torch.tensor([0, 3, 1], dtype=torch.int64, device=DEVICE)
    cos_sin_cache = torch.randn(4, 8, dtype=torch.float32, device=DEVICE)
    query = torch.randn(3, 2, 8, device=DEVICE)
    key = torch.randn(3, 1, 8, device=DEVICE)
    expected_q, expected_k = ref_rope(positions, query, key, 8, cos_sin_cache, True)
    tk.rope(positions, query, key, 8, cos_sin_cache, True)
    assert_close(query, expected_q, torch.float32)
    assert_close(key, expected_k, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 8, 16), (5, 33, 40), (37, 20, 70)])
def test_mm(m, n, k, dtype):
    check_mm(m, n, k, dtype, DEVICE)


@pytest.mark.parametrize("rows", [1, 16, 17, 32, 33, 64, 65, 8192])
def test_mm_autotunes_a_few_configs_a_decode_batch_fits_in_one_tile_of(rows):
    # The autotuner times every config it is given at every new (M, N, K); a tile as tall as the batch reads the
    # weight once (stop 36's 16-row tiles read it twice from 17 tokens on, at 1.2-1.6x cuBLAS's time).
    configs = tk._mm_configs_for(tk._MM_CONFIGS, {"M": rows, "N": 4096, "K": 4096})
    assert 0 < len(configs) <= 4 and all(c in tk._MM_CONFIGS for c in configs)
    assert rows > 64 or any(c.kwargs["BLOCK_M"] >= rows for c in configs)
    assert rows <= 64 or max(c.kwargs["BLOCK_M"] for c in configs) == 256  # prefill: the large tiles


def test_mm_keeps_leading_dims():
    a = torch.randn(2, 3, 24, device=DEVICE)
    b = torch.randn(10, 24, device=DEVICE)
    assert_close(tk.mm(a, b), ref_mm(a.reshape(-1, 24), b).reshape(2, 3, 10), torch.float32)


@pytest.mark.parametrize(
    "call",
    [
        lambda: tk.rmsnorm(torch.empty(0, 32, device=DEVICE), torch.ones(32, device=DEVICE), EPS),
        lambda: tk.silu_and_mul(torch.empty(0, 32, device=DEVICE)),
        lambda: tk.mm(torch.empty(0, 32, device=DEVICE), torch.empty(8, 32, device=DEVICE)),
    ],
    ids=["rmsnorm", "silu_and_mul", "mm"],
)
def test_zero_tokens_return_empty_without_launching(call):
    assert call().shape[0] == 0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: tk.rmsnorm(torch.ones(2, 8), torch.ones(6), EPS), "x has last dim 8, but weight has 6 elements"),
        (lambda: tk.silu_and_mul(torch.ones(2, 7)), "must be even"),
        (lambda: tk.mm(torch.ones(2, 8), torch.ones(3, 8, dtype=torch.float16)), "cast one so both match"),
        (lambda: tk.rope(torch.zeros(2, dtype=torch.int64), torch.ones(2, 8), torch.ones(2, 8), 4,
                         torch.ones(4, 8), True), "must be even and <= head_size 4"),
        (lambda: tk.fused_add_rmsnorm(torch.ones(4, 8).T, torch.ones(4, 8).T, torch.ones(4), EPS),
         "cannot be viewed"),
        # A float index was truncated, silently:
        (lambda: tk.rope(torch.zeros(2) + 0.7, torch.ones(2, 8), torch.ones(2, 8), 8, torch.ones(4, 8), True),
         "positions must be int64 or int32, got torch.float32"),
        # Rows that share memory, written in place, raced into one row; the torch backend refuses them:
        (lambda: tk.fused_add_rmsnorm(torch.ones(1, 8).expand(3, 8), torch.ones(3, 8), torch.ones(8), EPS),
         "x with shape .3, 8. and strides .0, 1. has rows that overlap"),
        (lambda: tk.fused_add_rmsnorm(torch.ones(3, 8), torch.ones(1, 8).expand(3, 8), torch.ones(8), EPS),
         "residual with shape .3, 8. and strides .0, 1. has rows that overlap"),
        (lambda: tk.rope(torch.zeros(3, dtype=torch.int64), torch.ones(1, 8).expand(3, 8), torch.ones(3, 8), 8,
                         torch.ones(4, 8), True), "query with shape .3, 8. and strides .0, 1. has rows that overlap"),
        # A 0-d weight raised IndexError from inside the wrapper:
        (lambda: tk.rmsnorm(torch.ones(2, 8), torch.tensor(1.0), EPS), "weight must be 1-D .hidden., got a 0-d"),
    ],
    ids=["rmsnorm-width", "odd-width", "mm-dtypes", "rope-rotary-dim", "in-place-needs-view", "rope-float-positions",
         "overlapping-x", "overlapping-residual", "overlapping-query", "0-d-weight"],
)
def test_bad_arguments_name_the_values(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("call, message", [
    # Each failed with Python's AttributeError ('list' object has no attribute 'shape' or 'dtype'):
    (lambda: tk.rmsnorm(torch.ones(2, 8), "w", EPS), "weight is a str; the op takes torch tensors"),
    (lambda: tk.fused_add_rmsnorm(torch.ones(2, 8), 0.0, torch.ones(8), EPS), "residual is a float; the op takes"),
    (lambda: tk.silu_and_mul([[1.0] * 8]), "x is a list; the op takes torch tensors"),
    (lambda: tk.mm([[1.0] * 8], torch.ones(4, 8)), "a is a list; the op takes torch tensors"),
    (lambda: tk.rope([0, 1], torch.ones(2, 64), torch.ones(2, 32), 16, torch.ones(8, 16), True),
     "positions is a list; the op takes torch tensors"),
], ids=["rmsnorm-weight", "fused-residual", "silu-x", "mm-a", "rope-positions"])
def test_an_argument_that_is_no_tensor_is_named(call, message):
    with pytest.raises(TypeError, match=message):
        call()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 127, 128, 129, 4096, 5120, 14336, 16384])
def test_host_side_grid_helpers_match_tritons(n):
    import triton

    from autosel.ops.common import next_power_of_2
    from autosel.ops.triton_kernels import _cdiv

    assert next_power_of_2(n) == triton.next_power_of_2(n)
    for d in (1, 7, 64, 1024):
        assert _cdiv(n, d) == triton.cdiv(n, d)
