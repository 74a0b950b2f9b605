"""What every paged attention backend checks of a batch before it plans: head size, dtype and GQA layout."""

from __future__ import annotations

_DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


def layout_reason(batch, *, backend: str, head_dims: tuple[int, ...], dtypes: tuple) -> str | None:
    """None where `backend` (a phrase naming it) takes the batch's head_dim, dtype and head counts, else why not."""
    if batch.head_dim not in head_dims:
        return f"{backend} takes head_dim {head_dims}, got {batch.head_dim}"
    if batch.dtype not in dtypes:
        names = " and ".join(_DTYPE_NAMES.get(str(d), str(d)) for d in dtypes)
        return f"{backend} takes {names}, got {batch.dtype}"
    if batch.num_q_heads % batch.num_kv_heads:
        return f"query heads ({batch.num_q_heads}) are not a multiple of KV heads ({batch.num_kv_heads})"
    return None
