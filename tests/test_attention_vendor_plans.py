"""CPU tests for what the flashinfer and FA3 attention plans compute before any vendor call: flashinfer's CSR form of
the page table, and the cases both modules decline (the vendors themselves run in tests/gpu/test_attention_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from autosel.ops import attention_fa3, attention_flashinfer
from paged_attention_cases import make_batch


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_paged_kv_csr_lists_each_sequences_pages_in_order(page_size):
    batch, _, _ = make_batch(seq_lens=[1, 9, 16, 33], page_size=page_size, num_q_heads=4, num_kv_heads=2,
                             head_dim=64, dtype=torch.bfloat16, device="cpu")
    indptr, indices, last = attention_flashinfer.paged_kv_csr(batch)
    pages = [-(-n // page_size) for n in batch.seq_lens_list]
    assert indptr.tolist() == [0] + torch.tensor(pages).cumsum(0).tolist()
    for b, n in enumerate(pages):
        assert indices[indptr[b]:indptr[b + 1]].tolist() == batch.page_table[b, :n].tolist()
    # last_page_len is 1..page_size, never 0: a sequence that fills its last page has page_size tokens there.
    assert last.tolist() == [n - (p - 1) * page_size for n, p in zip(batch.seq_lens_list, pages)]
    assert indptr.device.type == "cpu" and last.device.type == "cpu" and indices.dtype == torch.int32


@pytest.mark.parametrize("module", [attention_flashinfer, attention_fa3], ids=["flashinfer", "fa3"])
@pytest.mark.parametrize(("overrides", "words"), [
    ({"head_dim": 96}, "head_dim"),
    ({"dtype": torch.float32}, "bf16 and fp16"),
    ({"num_q_heads": 12, "num_kv_heads": 8}, "not a multiple"),
    ({}, "CUDA devices"),
])
def test_supports_declines_with_a_reason(module, overrides, words):
    fields = dict(seq_lens=[5, 9], page_size=16, num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                  device="cpu")
    fields.update(overrides)
    batch, _, _ = make_batch(**fields)
    assert words in module.supports(batch)


def test_flashinfer_tensor_cores_from_a_group_of_five():
    batch = make_batch(seq_lens=[3], page_size=1, num_q_heads=32, num_kv_heads=8, head_dim=64,
                       dtype=torch.bfloat16, device="cpu")[0]
    assert not attention_flashinfer.use_tensor_cores(batch)
    batch.num_kv_heads = 4
    assert attention_flashinfer.use_tensor_cores(batch)


def test_a_plan_too_large_for_the_workspace_is_planned_again_on_a_larger_one(monkeypatch):
    # flashinfer's CUDA-graph prefill plans outgrew the 128 MB workspace at 4 x 2048 new tokens and failed.
    monkeypatch.setattr(attention_flashinfer, "_WORKSPACE_BYTES", 16)
    monkeypatch.setattr(attention_flashinfer, "_MAX_WORKSPACE_BYTES", 64)
    monkeypatch.setattr(attention_flashinfer, "_workspaces", {})
    tried = []

    def plan(wrapper):
        tried.append(wrapper.numel())
        if wrapper.numel() < 40:
            raise RuntimeError("Buffer overflow ... Increase the workspace buffer size.")

    wrapper = attention_flashinfer._planned(lambda workspace: workspace, plan, "cpu")
    assert tried == [16, 32, 64] and wrapper.numel() == 64
    # Plans made later start from the grown workspace; a need beyond the cap, or another error, is raised.
    assert attention_flashinfer._workspace("cpu", 16).numel() == 64
    with pytest.raises(RuntimeError, match="Increase the workspace"):
        attention_flashinfer._planned(lambda workspace: workspace, _fails("Increase the workspace buffer size."), "cpu")
    with pytest.raises(RuntimeError, match="another error"):
        attention_flashinfer._planned(lambda workspace: workspace, _fails("another error"), "cpu")


def _fails(message):
    def plan(wrapper):
        raise RuntimeError(message)
    return plan
