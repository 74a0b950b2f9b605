"""activation.silu_and_mul and activation.gelu_and_mul: the gated MLP activations ([T, 2I] -> [T, I])."""

from __future__ import annotations

from autosel.ops.common import DTYPES, ShapesByDevice, dtype_name, dtype_of, rows_bucket, standard_specs, token_bucket
from autosel.spec import OpDefinition

# Intermediate sizes I: 3584 (Llama-3-70B at TP8), 14336 (Llama-3-8B), 18944 (Qwen2.5-7B),
# 28672 (Llama-3-70B at TP1); the input is [tokens, 2*I]. (512, 28672): in eager mode flashinfer's gelu falls
# behind triton at a few hundred to a thousand tokens of the widest rows (1.07x at 700 x 29568, 1.28x at 400 x
# 36864), where the nearest tuned buckets all chose flashinfer (commit b68e9eb). (4096, 1536) and (4096, 768),
# narrow rows as MoE experts have (Qwen3-235B-A22B's 1536, Qwen3-30B-A3B's 768): in graph mode triton took
# 1.20-1.33x flashinfer's time at 1750 and 4400 tokens of intermediate 1408 and no tuned bucket was within a factor
# of two, yet at 768 triton was 1.22-1.38x the faster, so a bucket won at 1536 alone sent 768's rows to flashinfer
# (held-out shapes, commits d9094d1 and 1d1ea1b).
SHAPES = ShapesByDevice(
    gpu=tuple({"tokens": t, "intermediate": i} for t, i in [
        (1, 14336), (1, 28672), (16, 18944), (128, 14336), (512, 3584), (512, 28672), (2048, 14336),
        (4096, 768), (4096, 1536), (4096, 18944), (8192, 3584), (16384, 14336),
    ]),
    # The CPU's leave no token bucket from 1 to 512 without a tuned one within a factor of two, as the norms' do
    # (without 4 tokens, 3 ran the op-level winner untimed); intermediate 7168 is within a factor of two of 3584
    # and 14336 (results/cpu-coverage-4-token-shapes/heldout.md).
    cpu=tuple({"tokens": t, "intermediate": i} for t, i in [(1, 14336), (4, 7168), (16, 3584), (128, 3584),
                                                             (256, 14336)]),
)


def gated_inputs(shape: dict, device: str) -> tuple:
    import torch

    return (torch.randn(shape["tokens"], 2 * shape["intermediate"], device=device, dtype=dtype_of(shape)),)


def gated_shape(x, *rest) -> dict:
    return {"tokens": token_bucket(x.numel() // x.shape[-1]), "intermediate": x.shape[-1] // 2,
            "dtype": dtype_name(x)}


SPECS = [
    *standard_specs("activation.silu_and_mul", "silu_and_mul",
                    flashinfer="autosel.ops.vendor_flashinfer:silu_and_mul", sgl_kernel="sgl_kernel:silu_and_mul"),
    *standard_specs("activation.gelu_and_mul", "gelu_and_mul",
                    flashinfer="autosel.ops.vendor_flashinfer:gelu_and_mul", sgl_kernel="sgl_kernel:gelu_and_mul"),
]
# Bucket: (token_bucket(tokens), the input's width 2 x intermediate).
DEFINITIONS = [
    OpDefinition("activation.silu_and_mul", shapes=SHAPES, make_inputs=gated_inputs, shape_of=gated_shape,
                 bucket=rows_bucket, route_key=0,
                 signature="(x[T, 2I]) -> new [T, I] = silu(x[:, :I]) * x[:, I:]; " + DTYPES,
                 traced="autosel.ops.opaque:silu_and_mul"),
    OpDefinition("activation.gelu_and_mul", shapes=SHAPES, make_inputs=gated_inputs, shape_of=gated_shape,
                 bucket=rows_bucket, route_key=0,
                 signature="(x[T, 2I]) -> new [T, I] = gelu(x[:, :I]) * x[:, I:] (exact gelu); " + DTYPES,
                 traced="autosel.ops.opaque:gelu_and_mul"),
]
