"""GPU tests for autosel.ops.triton_kernels: the checks of tests/test_triton_kernels.py at model-sized shapes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to compile Triton kernels")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def cases():
    # Imported lazily so that a machine without CUDA only skips, never runs the CPU module's interpreter setup.
    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    return importlib.import_module("test_triton_kernels")


# 40000 columns exceed the one-pass row limit for every dtype, so the chunked path runs too; 128 is a
# per-head norm, where several rows share one program. The others launch each plan's warps: 12288 (a 16-bit block of
# 16384: the plain norm 32 warps), 2048 (fp32: 8 warps), 210 x 6528 (fused add + rmsnorm's 16 warps at 200-299 rows
# past hidden 5120) and 250 x 4608 (its 8 warps there up to 5120).
NORM_SHAPES = [(1, 4096), (257, 8192), (513, 128), (3, 40000), (33, 12288), (64, 2048), (210, 6528), (250, 4608)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rmsnorm(cases, shape, dtype):
    cases.check_rmsnorm(shape, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_fused_add_rmsnorm(cases, shape, dtype):
    cases.check_fused_add_rmsnorm(shape, dtype, "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
# 1004 and 13 columns: no multiple of 8, so a 16-byte vector of 16-bit elements would straddle a row boundary; the
# kernel's width is a constant, and its loads must narrow where it does not divide them.
@pytest.mark.parametrize("shape", [(1, 2 * 14336), (300, 2 * 11008), (1750, 2 * 1408), (4099, 2 * 768),
                                   (37, 2 * 1004), (5, 2 * 13)])
@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_act_and_mul(cases, gelu, shape, dtype):
    fn, ref = ((cases.tk.gelu_and_mul, cases.ref_gelu_and_mul) if gelu
               else (cases.tk.silu_and_mul, cases.ref_silu_and_mul))
    cases.check_act_and_mul(fn, ref, shape, dtype, "cuda")


@pytest.mark.parametrize("gelu", [False, True], ids=["silu", "gelu"])
def test_act_and_mul_past_int32_offsets(cases, gelu):
    # 2^31 + 3 * 4096 output elements: int32 offsets would wrap in the last rows (12 GiB of bf16 in and out). Only
    # the first and last rows are checked against the reference, which would not fit beside them.
    tk = cases.tk
    n_rows, d = 2**31 // 4096 + 3, 4096
    assert tk._act_plan(n_rows, d, gelu)[1][3] is True  # WIDE
    x = torch.randn(n_rows, 2 * d, device="cuda", dtype=torch.bfloat16)
    out = (tk.gelu_and_mul if gelu else tk.silu_and_mul)(x)
    ref = cases.ref_gelu_and_mul if gelu else cases.ref_silu_and_mul
    for rows in (slice(0, 4), slice(n_rows - 8, n_rows)):
        cases.assert_close(out[rows], ref(x[rows]), torch.bfloat16)
    del x, out
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "n_tokens, n_q_heads, n_kv_heads, head_size, rotary_dim",
    # the key in one block of its own (32 / 8), in two (64 / 16), with the query's (40 / 8 at rotary 64, 8 / 1, 4 / 1)
    [(300, 32, 8, 128, 128), (33, 64, 16, 128, 128), (64, 40, 8, 128, 64), (7, 8, 1, 80, 80), (5, 4, 1, 128, 128)],
)
def test_rope(cases, n_tokens, n_q_heads, n_kv_heads, head_size, rotary_dim, is_neox, dtype):
    cases.check_rope(n_tokens=n_tokens, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, head_size=head_size,
                     rotary_dim=rotary_dim, is_neox=is_neox, dtype=dtype, device="cuda", max_pos=4096)


@pytest.mark.parametrize("dtype", DTYPES)
# One call in each token range of the autotuner's configs (triton_kernels._MM_CONFIGS_BY_ROWS).
@pytest.mark.parametrize("m, n, k", [(1, 4096, 4096), (24, 4096, 4096), (50, 1000, 999), (257, 1000, 999)])
def test_mm(cases, m, n, k, dtype):
    cases.check_mm(m, n, k, dtype, "cuda")
