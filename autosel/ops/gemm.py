"""gemm.mm: a @ b.T as linear layers run it, where small and large token counts favour different kernels."""

from __future__ import annotations

from autosel.dispatch import TracedTokens
from autosel.ops.common import DTYPES, ShapesByDevice, dtype_name, dtype_of, standard_specs, token_bucket
from autosel.spec import OpDefinition

# Llama-3-8B's projections (N, K): qkv (6144, 4096), o (4096, 4096), gate_up (28672, 4096), down (4096, 14336);
# M is the token count.
SHAPES = ShapesByDevice(
    gpu=tuple({"m": m, "n": n, "k": k} for m, n, k in [
        (1, 6144, 4096), (1, 28672, 4096), (16, 4096, 14336), (64, 6144, 4096), (128, 4096, 4096),
        (512, 28672, 4096), (1024, 4096, 14336), (4096, 6144, 4096), (8192, 4096, 4096), (16384, 4096, 14336),
    ]),
    cpu=tuple({"m": m, "n": n, "k": k} for m, n, k in [(1, 4096, 4096), (16, 6144, 4096), (64, 4096, 4096)]),
)


def mm_inputs(shape: dict, device: str) -> tuple:
    import torch

    dtype = dtype_of(shape)
    # Scaled so outputs stay O(1) whatever K is, which keeps bf16 tolerances meaningful.
    a = torch.randn(shape["m"], shape["k"], device=device, dtype=dtype)
    b = torch.randn(shape["n"], shape["k"], device=device, dtype=dtype) / shape["k"] ** 0.5
    return (a, b)


def mm_shape(a, b) -> dict:
    m, n, k = _mm_key(a, b, token_bucket)  # the dispatcher's bucket, so a [..., K] `a` records its M too
    return {"m": m, "n": n, "k": k, "dtype": dtype_name(a)}


def _mm_key(a, b, tokens_key) -> tuple:
    n, k = b.shape
    shape = a.shape
    return tokens_key(shape[0] if len(shape) == 2 else a.numel() // k), n, k


def mm_bucket(a, b) -> tuple:
    """(token_bucket(m), n, k): the token count and the weight's shape. Run once per distinct pair of shapes
    (route_key=(0, 1))."""
    return _mm_key(a, b, token_bucket)


mm_bucket.traced = lambda a, b: _mm_key(a, b, TracedTokens)  # what torch.compile traces


SPECS = standard_specs("gemm.mm", "mm")
DEFINITIONS = [OpDefinition("gemm.mm", shapes=SHAPES, make_inputs=mm_inputs, shape_of=mm_shape, bucket=mm_bucket,
                            route_key=(0, 1),
                            signature="(a[M, K], b[N, K]) -> new [M, N] = a @ b.T (nn.Linear layout); " + DTYPES,
                            traced="autosel.ops.opaque:mm")]
