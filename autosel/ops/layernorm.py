"""layernorm.rmsnorm and layernorm.fused_add_rmsnorm: declarations, shapes and input factories."""

from __future__ import annotations

from autosel.ops.common import DTYPES, ShapesByDevice, dtype_name, dtype_of, rows_bucket, standard_specs, token_bucket
from autosel.spec import OpDefinition

EPS = 1e-6

# Hidden sizes of open models: 2048 (Qwen3-1.7B), 4096 (Llama-3-8B), 5120 (Qwen3-32B), 7168 (DeepSeek-V3),
# 8192 (Llama-3-70B), 16384 (Llama-3.1-405B); token counts from one decode step to a 16k prefill. Each is its
# own bucket (tokens, hidden); an untuned bucket runs its nearest within a factor of two in every number. On the
# H200 the eager winner turns from the vendors' to triton between 1500 and 6000 tokens, so 4096 tokens is timed
# (in place of a second 1-token shape). 4 tokens (in place of 64, which 128 covers) leaves no token bucket from 1
# to 16384 without a tuned one within a factor of two: 4 had none, and in graph mode the vendors replayed 5-15%
# faster than triton at 3 tokens (commit bf50a14). In eager mode the vendors fall behind triton from
# about 4096 tokens at widths of 5120 and up (1.2-1.5x), but not at 4096 and below, where the three stay level:
# (4096, 7168) and (8192, 5120), in place of (8192, 4096), put a tuned bucket there, so 5000 x 7168 and
# 7000 x 5120 no longer run the vendors' pick of (4096, 4096) or (8192, 4096) (commit b68e9eb).
SHAPES = ShapesByDevice(
    gpu=tuple({"tokens": t, "hidden": h} for t, h in [
        (1, 4096), (4, 7168), (16, 5120), (128, 4096), (512, 8192), (2048, 2048), (2048, 16384),
        (4096, 4096), (4096, 7168), (8192, 5120), (8192, 7168), (16384, 5120), (16384, 8192),
    ]),
    # The CPU's follow the same rule from 1 to 1024 tokens: without (4, 4096), 3-10 tokens ran the op-level winner
    # (torch.compile), where torch took 0.55-0.93x its time (results/cpu-coverage-4-token-shapes/heldout.md).
    cpu=tuple({"tokens": t, "hidden": h} for t, h in [(1, 4096), (4, 4096), (16, 5120), (128, 4096), (512, 2048)]),
)


def rmsnorm_inputs(shape: dict, device: str) -> tuple:
    import torch

    dtype = dtype_of(shape)
    x = torch.randn(shape["tokens"], shape["hidden"], device=device, dtype=dtype)
    weight = 1.0 + 0.1 * torch.randn(shape["hidden"], device=device, dtype=dtype)
    return (x, weight, EPS)


def fused_add_rmsnorm_inputs(shape: dict, device: str) -> tuple:
    import torch

    x, weight, eps = rmsnorm_inputs(shape, device)
    return (x, torch.randn_like(x), weight, eps)


def rmsnorm_shape(x, *rest) -> dict:
    return {"tokens": token_bucket(x.numel() // x.shape[-1]), "hidden": x.shape[-1], "dtype": dtype_name(x)}


SPECS = [
    *standard_specs("layernorm.rmsnorm", "rmsnorm", flashinfer="autosel.ops.vendor_flashinfer:rmsnorm",
                    sgl_kernel="autosel.ops.vendor:sgl_rmsnorm"),
    *standard_specs("layernorm.fused_add_rmsnorm", "fused_add_rmsnorm",
                    flashinfer="autosel.ops.vendor_flashinfer:fused_add_rmsnorm",
                    sgl_kernel="autosel.ops.vendor:sgl_fused_add_rmsnorm"),
]
DEFINITIONS = [
    OpDefinition("layernorm.rmsnorm", shapes=SHAPES, make_inputs=rmsnorm_inputs, shape_of=rmsnorm_shape,
                 bucket=rows_bucket, route_key=0,  # (token_bucket(tokens), hidden)
                 signature="(x[T, H], weight[H], eps: float) -> new [T, H]; " + DTYPES,
                 traced="autosel.ops.opaque:rmsnorm"),
    OpDefinition("layernorm.fused_add_rmsnorm", shapes=SHAPES, make_inputs=fused_add_rmsnorm_inputs,
                 shape_of=rmsnorm_shape, bucket=rows_bucket, route_key=0, activations=(0, 1),
                 signature="(x[T, H], residual[T, H], weight[H], eps: float) -> None, in place: "
                           "residual <- x + residual, x <- rmsnorm(residual); " + DTYPES,
                 traced="autosel.ops.opaque:fused_add_rmsnorm"),
]
