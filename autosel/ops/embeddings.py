"""embeddings.rope: rotary position embedding with a cos/sin cache, in place on query and key."""

from __future__ import annotations

from autosel.buckets import TracedTokens
from autosel.ops.common import DTYPES, ShapesByDevice, dtype_name, dtype_of, standard_specs, token_bucket
from autosel.spec import OpDefinition


def _rope(tokens: int, q_heads: int, kv_heads: int, rotary_dim: int, is_neox: bool) -> dict:
    return {"tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_size": 128,
            "rotary_dim": rotary_dim, "is_neox": is_neox}


# Llama-3-8B (32 q / 8 kv heads, neox), Qwen3-32B (64 / 8, neox), GLM-4 (32 / 2, half the head rotated,
# GPT-J interleaved pairs), Llama-3-8B at tensor parallel 8 (4 / 1): a query of 512 columns is past a factor of two
# from the others, and in graph replays flashinfer took 16-19% less time than autosel's Triton kernel at 4 / 1 heads,
# 37 and 14500 tokens of held-out shapes (commit 547c865), while every bucket of the wider queries is triton's.
SHAPES = ShapesByDevice(
    gpu=(
        _rope(1, 32, 8, 128, True), _rope(64, 32, 8, 128, True), _rope(512, 32, 8, 128, True),
        _rope(4096, 32, 8, 128, True), _rope(16384, 32, 8, 128, True),
        _rope(128, 64, 8, 128, True), _rope(8192, 64, 8, 128, True),
        _rope(1, 32, 2, 64, False), _rope(2048, 32, 2, 64, False),
        _rope(64, 4, 1, 128, True), _rope(16384, 4, 1, 128, True),
    ),
    # 4 tokens: no token bucket from 1 to 64 without a tuned one within a factor of two (the norms' rule).
    cpu=(_rope(1, 32, 8, 128, True), _rope(4, 32, 8, 128, True), _rope(64, 32, 8, 128, True),
         _rope(16, 32, 2, 64, False)),
)
MAX_POSITIONS = 32768


def rope_inputs(shape: dict, device: str) -> tuple:
    import torch

    dtype, tokens, head_size = dtype_of(shape), shape["tokens"], shape["head_size"]
    rotary_dim = shape["rotary_dim"]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    angles = torch.outer(torch.arange(MAX_POSITIONS, dtype=torch.float32, device=device), inv_freq)
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, MAX_POSITIONS, (tokens,), device=device, dtype=torch.int64)
    query = torch.randn(tokens, shape["q_heads"] * head_size, device=device, dtype=dtype)
    key = torch.randn(tokens, shape["kv_heads"] * head_size, device=device, dtype=dtype)
    return (positions, query, key, head_size, cos_sin_cache, bool(shape["is_neox"]))


def rope_shape(positions, query, key, head_size, cos_sin_cache, is_neox=True) -> dict:
    return {"tokens": token_bucket(positions.numel()), "q_heads": query.shape[-1] // head_size,
            "kv_heads": key.shape[-1] // head_size, "head_size": head_size,
            "rotary_dim": cos_sin_cache.shape[-1], "is_neox": bool(is_neox), "dtype": dtype_name(query)}


def rope_bucket(positions, query, key, head_size=None, cos_sin_cache=None, is_neox=True) -> tuple:
    """(token_bucket(tokens), query width, is_neox), all read from query's one shape: the query
    width tells the models apart (heads x head size), and GPT-J's interleaved pairs run other code than neox's
    halves. The key's width is left out: reading it would cost a third of the budget of a dispatched call."""
    shape = query.shape
    tokens = shape[0]
    return (1 << ((tokens + (tokens >> 1)).bit_length() - 1) if tokens > 1 else 1, shape[-1], is_neox)


def _rope_traced_key(positions, query, key, head_size=None, cos_sin_cache=None, is_neox=True) -> tuple:
    return TracedTokens(query.shape[0]), query.shape[-1], is_neox


rope_bucket.traced = _rope_traced_key  # what torch.compile traces


SPECS = standard_specs("embeddings.rope", "rope",
                       flashinfer="autosel.ops.vendor_flashinfer:rope",
                       sgl_kernel="autosel.ops.vendor:sgl_rope")
DEFINITIONS = [OpDefinition(
    "embeddings.rope", shapes=SHAPES, make_inputs=rope_inputs, shape_of=rope_shape, bucket=rope_bucket,
    activations=(1, 2),  # query and key, which the QKV projection has just written; not positions or the cache
    signature="(positions[T] int64, query[T, Hq*D], key[T, Hk*D], head_size: int, cos_sin_cache[P, R] fp32, "
              "is_neox: bool) -> None, in place on query and key; cache rows [cos | sin]; " + DTYPES,
    traced="autosel.ops.opaque:rope",
)]
