"""flashinfer's paged attention as plans: `DecodePlan` (BatchDecodeWithPagedKVCacheWrapper) for attention.decode,
`ExtendPlan` (BatchPrefillWithPagedKVCacheWrapper, causal) for attention.extend, and `supports`.

Each plan converts the batch's page table into flashinfer's CSR form (kv_indptr and last_page_len on the host,
from the batch's plain-Python lengths, so nothing waits for the GPU; kv_indices gathered on the device), makes its
wrapper and calls its `plan()` once, in the constructor; `run()` is the wrapper's run, once per layer. The cache is
NHD: `[pages, page_size, kv_heads, head_dim]`, autosel's layout.

Backends inside flashinfer, pinned rather than left to flashinfer's "auto": fa2 for both. Decode runs flashinfer's
CUDA-core kernel up to 4 query heads per KV head and its tensor-core (prefill) kernel above, sglang's rule
(`should_use_tensor_core`: tensor cores from a GQA group of 5); "auto" could pick cuDNN or XQA paths that need
packages the GPU machine does not carry. Prefill's fa3 path would be a second FlashAttention-3 next to sgl-kernel's
(autosel.ops.attention_fa3).

With `cuda_graph=True` a plan's wrapper keeps its metadata in buffers of its own (flashinfer's CUDA-graph mode), so
`run()` can be captured and replayed as long as the plan lives.
"""

from __future__ import annotations

import torch

from autosel.ops.attention_support import layout_reason

_HEAD_DIMS = (64, 128, 256)
_DTYPES = (torch.bfloat16, torch.float16)
# flashinfer's CUDA-core decode kernel is compiled for these GQA groups (DISPATCH_GQA_GROUP_SIZE); wider groups go
# to the tensor-core kernel, which takes any.
_CUDA_CORE_GROUPS = (1, 2, 3, 4)
_WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace
_MAX_WORKSPACE_BYTES = 4 * 1024 ** 3


def supports(batch) -> str | None:
    """None where this module's plans run the batch's case (decode and extend alike), else why not."""
    reason = layout_reason(batch, backend="flashinfer's paged attention as autosel builds it", head_dims=_HEAD_DIMS,
                           dtypes=_DTYPES)
    if reason is not None:
        return reason
    if torch.device(batch.device).type != "cuda":
        return f"flashinfer runs on CUDA devices, the batch is on {batch.device}"
    return None


def use_tensor_cores(batch) -> bool:
    return batch.num_q_heads // batch.num_kv_heads not in _CUDA_CORE_GROUPS


# The kernels' working memory, not what autosel remembers of its choices (autosel.state): the plans made hold these
# buffers, so forgetting one at clear_cache() would free nothing.
_workspaces: dict[str, torch.Tensor] = {}


def _workspace(device: str, at_least: int) -> torch.Tensor:
    """The float workspace of a device, shared by every plan: flashinfer uses it only while a run() is in flight.
    Replaced by a larger one when a plan needs more; plans made before keep the one they were given."""
    buffer = _workspaces.get(device)
    if buffer is None or buffer.numel() < at_least:
        buffer = _workspaces[device] = torch.zeros(at_least, dtype=torch.uint8, device=device)
    return buffer


def _planned(make_wrapper, plan, device: str):
    """A wrapper made on the device's workspace and planned, on a workspace twice as large while flashinfer says
    it is too small: CUDA-graph prefill plans split for the worst case and outgrew 128 MB from 4 x 2048 new tokens
    (results/attention_bench_h100, "Increase the workspace buffer size")."""
    size = _WORKSPACE_BYTES
    while True:
        wrapper = make_wrapper(_workspace(device, size))
        try:
            plan(wrapper)
            return wrapper
        except RuntimeError as exc:
            if "Increase the workspace buffer size" not in str(exc) or size >= _MAX_WORKSPACE_BYTES:
                raise
            size *= 2


def paged_kv_csr(batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr on the host, kv_indices on the batch's device, last_page_len on the host), flashinfer's CSR form
    of the page table: sequence b's pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]."""
    page_size = batch.page_size
    pages = torch.tensor([-(-n // page_size) for n in batch.seq_lens_list], dtype=torch.int64)
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    last = torch.tensor([n - (-(-n // page_size) - 1) * page_size for n in batch.seq_lens_list], dtype=torch.int32)
    # The used table entries' coordinates come from the host-side lengths: a boolean mask on the device would need
    # its count back (a synchronisation).
    rows = torch.repeat_interleave(torch.arange(len(pages)), pages)
    cols = torch.arange(int(indptr[-1])) - torch.repeat_interleave(indptr[:-1].long(), pages)
    indices = batch.page_table[rows.to(batch.device, non_blocking=True), cols.to(batch.device, non_blocking=True)]
    return indptr, indices.to(torch.int32), last


class _Plan:
    def __init__(self, batch, cuda_graph: bool):
        reason = supports(batch)
        if reason is not None:
            raise ValueError(f"flashinfer paged attention cannot run this batch: {reason}")
        self.batch = batch
        self.cuda_graph = cuda_graph
        self.kv_indptr, self.kv_indices, self.last_page_len = paged_kv_csr(batch)


class DecodePlan(_Plan):
    """attention.decode through flashinfer's BatchDecodeWithPagedKVCacheWrapper, planned for one batch."""

    def __init__(self, batch, *, cuda_graph: bool = False):
        import flashinfer

        super().__init__(batch, cuda_graph)
        if any(q != 1 for q in batch.q_lens_list):
            raise ValueError("flashinfer decode takes one query token per sequence; use ExtendPlan for this batch")
        buffers = {}
        if cuda_graph:
            buffers = dict(paged_kv_indptr_buffer=self.kv_indptr.to(batch.device),
                           paged_kv_indices_buffer=self.kv_indices.clone(),
                           paged_kv_last_page_len_buffer=self.last_page_len.to(batch.device))
        self.wrapper = _planned(
            lambda workspace: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=cuda_graph, use_tensor_cores=use_tensor_cores(batch), backend="fa2",
                **buffers),
            lambda wrapper: wrapper.plan(
                self.kv_indptr, self.kv_indices, self.last_page_len, batch.num_q_heads, batch.num_kv_heads,
                batch.head_dim, batch.page_size, q_data_type=batch.dtype, kv_data_type=batch.dtype,
                sm_scale=batch.scale),
            batch.device)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q, (k_cache, v_cache))


class ExtendPlan(_Plan):
    """attention.extend through flashinfer's BatchPrefillWithPagedKVCacheWrapper (fa2, causal), planned for one
    batch: query i of sequence b sits at seq_len - q_len + i, flashinfer's bottom-right causal alignment."""

    def __init__(self, batch, *, cuda_graph: bool = False):
        import flashinfer

        super().__init__(batch, cuda_graph)
        qo_indptr = torch.zeros(len(batch.q_lens_list) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(batch.q_lens_list), 0)
        buffers = {}
        if cuda_graph:
            buffers = dict(qo_indptr_buf=qo_indptr.to(batch.device),
                           paged_kv_indptr_buf=self.kv_indptr.to(batch.device),
                           paged_kv_indices_buf=self.kv_indices.clone(),
                           paged_kv_last_page_len_buf=self.last_page_len.to(batch.device))
        self.wrapper = _planned(
            lambda workspace: flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                workspace, "NHD", use_cuda_graph=cuda_graph, backend="fa2", **buffers),
            lambda wrapper: wrapper.plan(
                qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len, batch.num_q_heads,
                batch.num_kv_heads, batch.head_dim, batch.page_size, causal=True, sm_scale=batch.scale,
                q_data_type=batch.dtype, kv_data_type=batch.dtype),
            batch.device)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q, (k_cache, v_cache))
