"""route_paged_attention: transformers' continuous batching (generate_batch and its paged cache) with attention run
by autosel's planned ops, attention.decode and attention.extend, planned once per step and run by every layer.

How it reaches transformers 5.24.0 without copying its attention code: an attention function registered with
transformers (AttentionInterface, under NAME) and named in each routed attention module's own copy of the config,
while the model's config keeps "sdpa" or "paged|eager". Continuous batching accepts only those two or a flash
implementation (continuous_api.py, switch_to_cb_friendly_attn), and a registered name containing "flash" is taken for
a Hub kernel and refused (modeling_utils.py, _check_and_adjust_attn_implementation), so the model must keep a name
transformers accepts while its attention layers call autosel. A forward pre-hook on the model takes each step's
PagedAttentionCache (the attention function is not passed it); the step's first attention call builds its PagedBatch
and plan, and every layer of the step runs that plan on its own K/V pages.

transformers' cache is one flat tensor in which each block holds, per layer, a page of K then a page of V; the page
views it keeps for its flash decode path (`get_cache_for_block_table`) are [pages, page_size, kv_heads, head_dim]
views with no copy, autosel's layout, and a token's row in them is its read index. The page table is taken from the
step's read indices (the first token of each page, divided by page_size), on the device, and the layers are passed
none, so that transformers writes the new tokens' K/V into the pages but copies none back out for attention.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from typing import Any, Callable

import torch
from transformers import AttentionInterface, ContinuousBatchingConfig
from transformers.generation.continuous_batching import PagedAttentionCache
from transformers.generation.continuous_batching.cache import group_layers_by_attn_type
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import autosel
from autosel import platforms
from autosel.errors import IntegrationError
from autosel.integrations.transformers import FAMILIES, WRITTEN_FOR
from autosel.paged import PagedBatch

log = logging.getLogger(__name__)

NAME = "autosel_paged"  # the name autosel's attention function is registered under in transformers' AttentionInterface
ACCEPTED = ("sdpa", "paged|eager")  # the non-flash implementations continuous batching accepts for the model's config
OPS = ("attention.decode", "attention.extend")


def route_paged_attention(model, *, backend: str | None = None, mode: str | None = None) -> PagedAttention:
    """Run `model`'s attention through autosel's attention.decode / attention.extend wherever it runs with
    transformers' paged cache (generate_batch, init_continuous_batching); other forwards keep the model's own
    attention. Pass `routed.batching_config(...)` as generate_batch's continuous_batching_config.

    Refused, with the reason, before anything changes: a family other than Llama, Mistral, Qwen2, Qwen3; sliding-window
    layers (transformers' sliding cache keeps only the window; autosel's ops attend to the whole prefix); attention
    sinks; logit soft-capping; a model already routed."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        raise IntegrationError(f"{type(model).__name__} has model_type {family!r}; route_paged_attention routes "
                               f"{', '.join(FAMILIES)} models only. The model is unchanged.")
    if getattr(model, "_autosel_paged", None) is not None:
        raise IntegrationError(f"{type(model).__name__}'s attention is already routed through autosel; call undo() on "
                               "its handle (model._autosel_paged) first")
    config = model.config
    groups = group_layers_by_attn_type(config)
    if set(groups) != {"full_attention"}:
        raise IntegrationError(
            f"{type(model).__name__} has sliding-window attention (layer types {sorted(groups)}, sliding_window="
            f"{getattr(config, 'sliding_window', None)}): transformers' paged cache keeps only the window for those "
            "layers, and autosel's paged ops attend to the whole prefix. Run it on transformers' own attention, or "
            "set config.sliding_window = None if the model is to attend to the whole prefix. The model is unchanged.")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise IntegrationError(f"{type(model).__name__} soft-caps attention logits (attn_logit_softcapping="
                               f"{config.attn_logit_softcapping}), which autosel's paged ops do not. The model is "
                               "unchanged.")
    inner = getattr(model, "model", model)
    modules = [layer.self_attn for layer in getattr(inner, "layers", [])]
    problems = [f"layer {i}'s {type(m).__name__} has no {name}" for i, m in enumerate(modules)
                for name in ("layer_idx", "config", "scaling") if not hasattr(m, name)]
    problems += [f"layer {i} has attention sinks" for i, m in enumerate(modules) if hasattr(m, "sinks")]
    problems += [f"layer {i} is not causal" for i, m in enumerate(modules) if getattr(m, "is_causal", True) is False]
    if not modules or problems:
        raise IntegrationError(f"{type(model).__name__} is not what route_paged_attention routes (written for "
                               f"transformers {WRITTEN_FOR}): {'; '.join(problems) or 'no decoder layers'}. The model "
                               "is unchanged.")

    planners = {}
    # Resolved (and on a miss tuned) before the first change, so that a failure leaves the model as it was.
    for op in OPS:
        if backend is not None:  # an explicit backend is not checked against the device (the contract): check it here
            reason = autosel.select_kernel(op, backend).unavailable_reason(platforms.current_platform())
            if reason:
                raise IntegrationError(f"backend={backend!r} cannot run {op} on this machine ({reason}); route without "
                                       "backend= to let autosel choose among the eligible backends")
        planners[op] = autosel.get_kernel(op, backend, mode=mode)
    return PagedAttention(model, modules, planners)


class PagedAttention:
    """What route_paged_attention changed and what it has run since: `plans` (op -> plans built, one per step),
    `layer_calls` (attention calls on those plans), `backends` (backend -> plans, where autosel chose the backend),
    `undo()`. A context manager too: the model is restored when the block ends."""

    def __init__(self, model, modules: list, planners: dict[str, Any]) -> None:
        self.model, self.planners = model, planners
        self.plans: Counter[str] = Counter()
        self.backends: Counter[str] = Counter()
        self.layer_calls = 0
        self._step: Step | None = None
        self._steps: list[Callable[[], None]] = []
        for module in modules:
            own = module.config
            routed = own.__class__.__new__(own.__class__)
            routed.__dict__.update(own.__dict__)  # a shallow copy: the model's sub-configs stay shared, unchanged
            routed._attn_implementation_internal = NAME  # the setter would also rename the shared sub-configs
            module.config, module._autosel_paged = routed, self
            self._steps.append(lambda module=module, own=own: (setattr(module, "config", own),
                                                                delattr(module, "_autosel_paged")))
        hooks = (model.register_forward_pre_hook(self._begin, with_kwargs=True),
                 model.register_forward_hook(self._end, always_call=True))
        self._steps.append(lambda: [hook.remove() for hook in hooks])
        model._autosel_paged = self
        self._steps.append(lambda: delattr(model, "_autosel_paged"))

    def batching_config(self, **settings: Any) -> ContinuousBatchingConfig:
        """generate_batch's continuous_batching_config with what this route needs: transformers' own attention
        implementation kept (auto_switch_to_flash=False), its flash decode path off (max_blocks_per_request=0: it
        writes the cache inside flash_attn_with_kvcache) and no CUDA graphs (a plan is built on the host each step)."""
        fixed = {"auto_switch_to_flash": False, "max_blocks_per_request": 0, "use_cuda_graph": False}
        clash = {k: v for k, v in settings.items() if k in fixed and v != fixed[k]}
        if clash:
            raise ValueError(f"batching_config({', '.join(f'{k}={v!r}' for k, v in clash.items())}): autosel's paged "
                             f"attention needs {', '.join(f'{k}={fixed[k]!r}' for k in clash)}")
        return ContinuousBatchingConfig(**{**settings, **fixed})

    def undo(self) -> None:
        """Give every attention module its config back and remove the hooks; a second call does nothing."""
        while self._steps:
            self._steps.pop()()

    def __enter__(self) -> PagedAttention:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def _begin(self, model, args, kwargs):
        cache = kwargs.get("cache")
        if not isinstance(cache, PagedAttentionCache):
            self._step = None
            return None
        self._step = Step(cache, kwargs.get("read_index"))
        # Given read indices, transformers' cache.update gathers every cached token's K/V into new tensors for each
        # layer (allocator.update's index_select) before attention is called; autosel's plans read the pages instead.
        # With empty ones it only writes the new tokens, as it does for a batch of first prefills.
        return args, {**kwargs, "read_index": [index[:0] for index in kwargs.get("read_index") or []]}

    def _end(self, model, args, output) -> None:
        self._step = None  # the step's indices and plan are not kept past its forward

    def attend(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """One layer's attention: on the step's plan where the forward runs with a paged cache, else the model's own."""
        step = self._step
        if step is None:
            fallback = sys.modules[type(module).__module__].eager_attention_forward
            own = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, fallback)
            return own(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        if dropout:
            raise IntegrationError(f"attention dropout {dropout} (the model is training): autosel's paged attention "
                                   "runs inference only; call model.eval()")
        if query.is_cuda and torch.cuda.is_current_stream_capturing():
            raise IntegrationError("transformers is capturing a CUDA graph of the step, whose replays would run other "
                                   "batches on this step's plan; use routed.batching_config(), which turns graphs off")
        if scaling is None:  # transformers' attention functions default to 1/sqrt(head_dim) alike
            scaling = query.shape[-1] ** -0.5
        if step.plan is None:
            step.begin(self, kwargs, query, scaling)
        elif kwargs.get("cu_seq_lens_q") is not step.cu_seq_lens_q:
            raise IntegrationError("an attention layer ran with other batch indices than the step's first layer "
                                   "(transformers called attention outside the forward the step began)")
        batch = step.batch
        if query.shape[1] != batch.num_q_heads or query.shape[-1] != batch.head_dim or scaling != batch.scale:
            raise IntegrationError(f"layer {module.layer_idx} has {query.shape[1]} query heads of {query.shape[-1]} "
                                   f"at scale {scaling}, the step's plan {batch.num_q_heads} of {batch.head_dim} at "
                                   f"{batch.scale}: layers of one model must share a layout to share a plan")
        k_cache, v_cache = step.cache.layer_to_allocator[module.layer_idx].get_cache_for_block_table(module.layer_idx)
        self.layer_calls += 1
        out = step.plan.run(query[0].transpose(0, 1).contiguous(), k_cache, v_cache)  # [tokens, q_heads, head_dim]
        return out.unsqueeze(0), None


class Step:
    """One forward of continuous batching: its cache, and the batch and plan its first attention call builds."""

    __slots__ = ("cache", "read_index", "cu_seq_lens_q", "batch", "plan")

    def __init__(self, cache: PagedAttentionCache, read_index: list | None) -> None:
        self.cache, self.read_index = cache, read_index  # the step's own read indices (the layers are passed none)
        self.cu_seq_lens_q = self.batch = self.plan = None

    def begin(self, route: PagedAttention, kwargs: dict, query: torch.Tensor, scaling: float) -> None:
        self.batch = paged_batch(self.cache, {**kwargs, "read_index": self.read_index}, query, scaling)
        op = "attention.decode" if self.batch.is_decode else "attention.extend"
        planner = route.planners[op]
        self.plan = planner.plan(self.batch)
        self.cu_seq_lens_q = kwargs["cu_seq_lens_q"]  # the step's own tensor: every layer of the step is passed it
        route.plans[op] += 1
        chosen = planner.backend_of(self.batch)
        if chosen is not None:
            route.backends[chosen] += 1


def paged_batch(cache: PagedAttentionCache, kwargs: dict, query: torch.Tensor, scaling: float) -> PagedBatch:
    """The step's PagedBatch from transformers' indices, or IntegrationError naming what it cannot describe."""
    if kwargs.get("block_table") is not None:
        raise IntegrationError("transformers passed a block table: its flash decode path, which leaves writing the "
                               "new tokens' K/V to flash_attn_with_kvcache; use routed.batching_config(), which turns "
                               "it off (max_blocks_per_request=0)")
    allocator = cache.cache_allocators["full_attention"]  # route_paged_attention refused any other layer type
    cu_q = kwargs["cu_seq_lens_q"].tolist()  # on a GPU, the step's one wait for the device: lengths key the plan
    cu_k = kwargs["cu_seq_lens_k"]
    cu_k_list = cu_k.tolist()
    q_lens = [b - a for a, b in zip(cu_q, cu_q[1:])]
    seq_lens = [b - a for a, b in zip(cu_k_list, cu_k_list[1:])]
    if len(q_lens) != len(seq_lens) or 0 in q_lens or cu_q[-1] != query.shape[2]:
        raise IntegrationError(f"a padded batch ({query.shape[2]} query tokens, sequences of {q_lens} new and "
                               f"{seq_lens} cached tokens): transformers pads for CUDA graphs and torch.compile, "
                               "and autosel's ops take no empty sequence; use routed.batching_config() and leave "
                               "compile off")
    read_index, write_index = kwargs["read_index"][allocator.index], kwargs["write_index"][allocator.index]
    # With nothing cached yet (every sequence a first prefill) transformers passes no read indices; the write
    # indices then list every token of each sequence, in the same order.
    index = read_index if read_index.numel() else write_index
    if index.numel() < cu_k_list[-1] or (index is write_index and q_lens != seq_lens):
        raise IntegrationError(f"transformers' {len(index)} cache indices do not cover the step's {cu_k_list[-1]} "
                               "cached tokens; this transformers is not the 5.24 continuous batching "
                               "route_paged_attention reads")
    page_size = allocator.tokens_per_page
    width = max(-(-n // page_size) for n in seq_lens)
    starts = cu_k.to(device=index.device, dtype=torch.long)
    offsets = torch.arange(width, device=index.device) * page_size
    # Entry j of sequence b is the row of its token j * page_size; slots past its last page repeat its first.
    inside = offsets[None, :] < (starts[1:] - starts[:-1])[:, None]
    positions = starts[:-1, None] + torch.where(inside, offsets[None, :], 0)
    page_table = torch.div(index[positions], page_size, rounding_mode="floor").to(torch.int32)
    if allocator.cache_dtype != query.dtype:
        raise IntegrationError(f"the paged cache holds {allocator.cache_dtype} and the queries are {query.dtype}; "
                               "autosel's paged ops take one dtype for both")
    return PagedBatch.build(page_table=page_table, seq_lens=seq_lens, q_lens=q_lens, page_size=page_size,
                            num_q_heads=query.shape[1], num_kv_heads=allocator.num_key_value_heads,
                            head_dim=query.shape[-1], dtype=query.dtype, scale=scaling)


def paged_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The attention function registered as NAME: the route of `module`'s model decides per call."""
    route = getattr(module, "_autosel_paged", None)
    if route is None:
        raise IntegrationError(f"{type(module).__name__}'s config names attention {NAME!r}, but its model was not "
                               "routed by autosel.integrations.transformers_paged.route_paged_attention")
    return route.attend(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(NAME, paged_attention_forward)
