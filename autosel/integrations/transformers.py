"""patch_model: run a loaded transformers Llama, Mistral, Qwen2 or Qwen3 model through autosel's kernels, undoably.

The kernels are resolved once, when the model is patched (get_kernel with the mode given: a model that will be
captured in a CUDA graph is patched with mode="graph"), and the replacement forwards call them directly: a forward
does no selection and no DB read. Forwards are replaced on module instances, never on transformers' classes, so
two models can differ and undo() restores each module exactly. The replacement forwards mirror transformers
5.24.0's code; everything they rely on is checked before anything changes, and a model that does not have that
structure raises IntegrationError (naming the version this was written for when another is installed).
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from typing import Any, Callable

try:
    import transformers
    from transformers.activations import SiLUActivation
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
except ImportError as exc:  # pragma: no cover - the tests skip without transformers
    raise ImportError("autosel.integrations.transformers needs transformers: pip install 'autosel[hf]'") from exc
import torch

import autosel
from autosel import platforms, selector
from autosel.errors import IntegrationError

log = logging.getLogger(__name__)

WRITTEN_FOR = "5.24.0"  # the transformers release whose decoder layer, attention and MLP code is mirrored here
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
KINDS = ("rmsnorm", "fused_add_rmsnorm", "rope", "silu_and_mul", "gemm")
OPS = {"rmsnorm": "layernorm.rmsnorm", "fused_add_rmsnorm": "layernorm.fused_add_rmsnorm", "rope": "embeddings.rope",
       "silu_and_mul": "activation.silu_and_mul", "gemm": "gemm.mm"}  # the autosel op each kind calls
# The parameters the replaced forwards take, in transformers' order; a release that renames one fails the check.
LAYER_PARAMS = ("hidden_states", "attention_mask", "position_ids", "cache", "use_cache", "position_embeddings")
ATTENTION_PARAMS = ("hidden_states", "position_embeddings", "attention_mask", "cache")
# Where each family's attention takes its sliding window from (Llama passes none); Qwen3 also norms q and k per head.
SLIDING: dict[str, Callable[[Any], Any] | None] = {
    "llama": None, "mistral": lambda attn: getattr(attn.config, "sliding_window", None),
    "qwen2": lambda attn: attn.sliding_window, "qwen3": lambda attn: attn.sliding_window}
QK_NORM = {"qwen3"}
NEEDS = {"layer": ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp"),
         "attention": ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "layer_idx", "scaling", "config"),
         "mlp": ("gate_proj", "up_proj", "down_proj", "act_fn"), "norm": ("weight", "variance_epsilon")}


class PatchedModel:
    """What patch_model changed: `counts` per kind, `skipped` (kind -> why it was left to transformers), `kernels`
    (op -> the callable get_kernel resolved for it, which the forwards call), `undo()`.

    Also a context manager: the model is restored when the block ends."""

    def __init__(self, model, *, counts: dict[str, int], skipped: dict[str, str], mode: str,
                 steps: list[Callable[[], None]], kernels: dict[str, Callable] | None = None) -> None:
        self.model, self.counts, self.skipped, self.mode = model, counts, skipped, mode
        self.kernels = kernels or {}
        self._steps = steps

    def undo(self) -> None:
        """Restore every replaced forward and the gate/up weights' own storage; a second call does nothing."""
        while self._steps:
            self._steps.pop()()

    def __enter__(self) -> PatchedModel:
        return self

    def __deepcopy__(self, memo) -> PatchedModel:
        # copy.deepcopy(model) reaches here through model._autosel_patch. The forwards are closures over this model's
        # modules, which deepcopy does not copy: the copy ran the original's weights, and its handle undid the
        # original.
        raise IntegrationError(f"{type(self.model).__name__} is patched by autosel, and a deep copy of it would run "
                               "the original's modules; call undo() on its handle (model._autosel_patch), copy, then "
                               "patch the copy")

    def __exit__(self, *exc) -> None:
        self.undo()

    def __str__(self) -> str:
        done = ", ".join(f"{kind} {n}" for kind, n in self.counts.items() if n)
        left = "; ".join(f"{kind}: {why}" for kind, why in self.skipped.items())
        return (f"autosel patched {type(self.model).__name__} (transformers {transformers.__version__}, mode "
                f"{self.mode}): {done}" + (f"; left to transformers: {left}" if left else ""))


def patch_model(model, *, backend: str | None = None, mode: str | None = None, fuse: bool = True,
                projections: bool = False, graph_from_tokens: int | None = None) -> PatchedModel:
    """Route `model`'s RMSNorms, residual add + RMSNorm (fuse), rotary embedding, SiLU gated MLP and, with
    projections=True, its linear layers (gemm.mm) through autosel.get_kernel(op, backend, mode=mode).

    graph_from_tokens (eager mode only): calls of at least this many tokens run the graph-mode decisions, which
    are chosen on the device's time alone. In a long eager prefill the GPU, busy with the projections and the
    attention, is what the step waits for, and the host's launch time is hidden; in a short one it is not. On the
    H200 with Llama-3-8B's sizes the crossover lay between 512 and 2048 tokens (commit 38b686a).

    Patch the model for inference, after it is on its device and in its dtype, and undo() before moving, training
    or saving it: the rope cache and the fused gate/up weight are built here on the model's device.
    """
    resolved = selector.resolve_mode(mode, platforms.current_platform())  # checks mode; what kernels are chosen for
    if graph_from_tokens is not None and ("graph" in (mode, resolved) or not isinstance(graph_from_tokens, int)
                                          or graph_from_tokens < 1):
        raise ValueError(f"graph_from_tokens={graph_from_tokens!r} with mode {mode or resolved!r}: it takes a token "
                         "count of at least 1, and only in eager mode (in graph mode every call runs the graph "
                         "decisions)")
    if getattr(model, "_autosel_patch", None) is not None:
        raise IntegrationError(f"{type(model).__name__} is already patched by autosel; call undo() on its handle "
                               "(model._autosel_patch) before patching it again")
    family, inner = check_model(model)
    if transformers.__version__.rsplit(".", 1)[0] != WRITTEN_FOR.rsplit(".", 1)[0]:
        warnings.warn(f"autosel.integrations.transformers was written for transformers {WRITTEN_FOR}; transformers "
                      f"{transformers.__version__} has the structure it checks, but compare the patched model's "
                      "logits with the unpatched model's once (tools/hf_check.py does)", stacklevel=2)
    layers = list(inner.layers)
    # An RMSNorm this code does not know about (a later release's new norm) must not stay silently unpatched.
    known = {id(inner.norm), *(id(getattr(module, name)) for layer in layers for module, names in (
        (layer, ("input_layernorm", "post_attention_layernorm")),
        (layer.self_attn, ("q_norm", "k_norm") if family in QK_NORM else ())) for name in names)}
    missed = [name for name, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and id(m) not in known]
    if missed:
        raise structure_error(family, [f"RMSNorm modules this integration does not route: {', '.join(missed[:4])}"])
    table, rope_skip = rope_cache(inner.rotary_emb, layers[0].self_attn.head_dim)
    skipped = {"rope": rope_skip} if rope_skip else {}
    act = layers[0].mlp.act_fn
    if not isinstance(act, (torch.nn.SiLU, SiLUActivation)):
        skipped["silu_and_mul"] = f"the MLP's activation is {type(act).__name__}, not SiLU"
    elif any(type(getattr(layer.mlp, p)) is not torch.nn.Linear for layer in layers for p in ("gate_proj", "up_proj")):
        skipped["silu_and_mul"] = "gate_proj or up_proj is not a torch.nn.Linear, so their weights cannot be fused"
    if not projections:
        skipped["gemm"] = "projections=False"

    kernels: dict[str, Callable] = {}

    def kernel(kind: str) -> Callable:
        op = OPS[kind]
        if backend is not None:  # an explicit backend is not checked against the device (the contract): here it
            reason = autosel.select_kernel(op, backend).unavailable_reason(platforms.current_platform())
            if reason:  # would fail at the first forward, far from its cause
                raise IntegrationError(f"backend={backend!r} cannot run {op} on this machine ({reason}); patch "
                                       "without backend= to let autosel choose among the eligible backends")
        kernels[op] = autosel.get_kernel(op, backend, mode=mode)
        if graph_from_tokens is not None:
            graph = autosel.get_kernel(op, backend, mode="graph")
            kernels[op] = autosel.by_tokens(kernels[op], graph, graph_from_tokens)
        return kernels[op]

    # Resolve (and on a miss tune) every kernel before the first change, so that a failure leaves the model as it was.
    rmsnorm, fused = kernel("rmsnorm"), kernel("fused_add_rmsnorm") if fuse else None
    rope = kernel("rope") if "rope" not in skipped else None
    silu_and_mul = kernel("silu_and_mul") if "silu_and_mul" not in skipped else None
    mm = kernel("gemm") if projections else None

    counts = dict.fromkeys(KINDS, 0)
    steps: list[Callable[[], None]] = []

    def replace(kind: str, module: torch.nn.Module, forward: Callable) -> None:
        had, old = "forward" in module.__dict__, module.__dict__.get("forward")
        module.forward = forward
        steps.append(lambda: setattr(module, "forward", old) if had else delattr(module, "forward"))
        counts[kind] += 1

    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = [layer.input_layernorm, *((attn.q_norm, attn.k_norm) if family in QK_NORM else ())]
        for norm in norms if fuse else [*norms, layer.post_attention_layernorm]:
            replace("rmsnorm", norm, rmsnorm_forward(norm, rmsnorm))
        if fuse:
            replace("fused_add_rmsnorm", layer, layer_forward(layer, fused))  # post_attention_layernorm inside
        if rope is not None:
            replace("rope", attn, attention_forward(attn, rope, table, SLIDING[family], family in QK_NORM))
        if silu_and_mul is not None:
            replace("silu_and_mul", mlp, mlp_forward(mlp, silu_and_mul, fuse_gate_up(mlp, steps), mm))
        if mm is not None:
            linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.down_proj)
            for linear in linears + (() if silu_and_mul is not None else (mlp.gate_proj, mlp.up_proj)):
                replace("gemm", linear, linear_forward(linear, mm))
            counts["gemm"] += silu_and_mul is not None  # gate/up as one fused projection inside the MLP
    replace("rmsnorm", inner.norm, rmsnorm_forward(inner.norm, rmsnorm))
    if mm is not None and type(getattr(model, "lm_head", None)) is torch.nn.Linear:
        replace("gemm", model.lm_head, linear_forward(model.lm_head, mm))

    handle = PatchedModel(model, counts=counts, skipped=skipped, mode=resolved, steps=steps, kernels=kernels)
    model._autosel_patch = handle
    steps.insert(0, lambda: delattr(model, "_autosel_patch"))
    for kind, why in skipped.items():
        if kind != "gemm":
            warnings.warn(f"autosel left {kind} to transformers: {why}", stacklevel=2)
    log.info("%s", handle)
    return handle


def structure_error(family: str | None, problems: list[str]) -> IntegrationError:
    if transformers.__version__ == WRITTEN_FOR:  # the model itself differs (an emptied or edited one): no install helps
        return IntegrationError(f"the {family} model is not what autosel.integrations.transformers replaces: "
                                f"{'; '.join(problems)}. The model is unchanged: run it unpatched.")
    return IntegrationError(
        f"autosel.integrations.transformers was written for transformers {WRITTEN_FOR}; with transformers "
        f"{transformers.__version__} the {family} model is not what it replaces: {'; '.join(problems)}. The model is "
        f"unchanged: install transformers=={WRITTEN_FOR}, or run this model unpatched.")


def check_model(model) -> tuple[str, torch.nn.Module]:
    """(family, the decoder stack) when `model` has every attribute and forward signature the patch relies on."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family not in FAMILIES:
        raise IntegrationError(f"{type(model).__name__} has model_type {family!r}; autosel.integrations.transformers "
                               f"patches {', '.join(FAMILIES)} models only. The model is unchanged.")
    hooked = [name for name, module in model.named_modules() if hasattr(module, "_hf_hook")]
    if hooked:  # autosel's forwards would replace accelerate's, which load offloaded weights and move tensors
        raise IntegrationError(f"{type(model).__name__} is dispatched by accelerate (a device_map with hooks on "
                               f"{hooked[0] or 'the model'}{' and more' if len(hooked) > 1 else ''}): autosel's "
                               "forwards would bypass its hooks. Load the model onto one device (device_map=None or "
                               "a single device, no offloading) to patch it. The model is unchanged.")
    inner = getattr(model, "model", model)
    problems = [f"{type(inner).__name__} has no {name}" for name in ("layers", "norm", "rotary_emb")
                if not hasattr(inner, name)]
    if not problems and len(inner.layers) == 0:
        problems.append(f"{type(inner).__name__}.layers is empty")
    for layer in [] if problems else inner.layers:
        parts = {"layer": layer, "attention": getattr(layer, "self_attn", None), "mlp": getattr(layer, "mlp", None)}
        for what, module in parts.items():
            problems += [f"{type(module).__name__} has no {name}" for name in NEEDS[what] if not hasattr(module, name)]
        norms = [getattr(layer, n, None) for n in NEEDS["layer"][:2]]
        if family in QK_NORM:
            norms += [getattr(parts["attention"], n, None) for n in ("q_norm", "k_norm")]
        problems += [f"{type(n).__name__} has no {a}" for n in norms for a in NEEDS["norm"] if not hasattr(n, a)]
        for module, expected in ((layer, LAYER_PARAMS), (parts["attention"], ATTENTION_PARAMS)):
            params = tuple(inspect.signature(type(module).forward).parameters)[1:len(expected) + 1]
            if params != expected:
                problems.append(f"{type(module).__name__}.forward takes ({', '.join(params)}), expected "
                                f"({', '.join(expected)})")
        if not hasattr(sys.modules[type(parts["attention"]).__module__], "eager_attention_forward"):
            problems.append(f"{type(parts['attention']).__module__} has no eager_attention_forward")
    if problems:
        raise structure_error(family, list(dict.fromkeys(problems)))  # once per class, not once per layer
    return family, inner


class RopeTable:
    """The model's [positions, head_dim] fp32 [cos | sin] table, shared by its attention layers, and grown when a call
    can reach past it: transformers computes cos/sin per call from the positions, so it has no length limit.

    Built with transformers' own arithmetic (position * inv_freq in fp32, then cos/sin times attention_scaling),
    so the table equals transformers' cos/sin before it rounds them to the model's dtype; autosel's rope then
    rotates in fp32 and rounds once, where transformers rotates in the model's dtype: within bf16 tolerance."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, rows: int) -> None:
        self.inv_freq, self.scale = inv_freq, scale
        self.table = self.build(rows)
        self.retired: list[torch.Tensor] = []  # outgrown tables: a CUDA graph captured earlier still reads them

    def build(self, rows: int) -> torch.Tensor:
        positions = torch.arange(rows, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.float()[None, :]
        return torch.cat((freqs.cos() * self.scale, freqs.sin() * self.scale), dim=-1)

    def covering(self, rows: int) -> torch.Tensor:
        """The table with at least `rows` positions; it at least doubles when it grows, so that decoding past it
        grows it a few times, not at every token."""
        if rows <= self.table.shape[0]:
            return self.table
        if torch.compiler.is_compiling():
            # Code torch.compile traces builds the rows it needs per call and keeps them out of self.table: under
            # mode="reduce-overhead" a tensor made in the graph lives in its CUDA graphs' memory, which the next
            # replay overwrote, so a stored table read garbage (commit 28668cc). Eager calls grow the stored table.
            return self.build(rows)
        if self.table.is_cuda and torch.cuda.is_current_stream_capturing():
            raise IntegrationError(
                f"a call reaches position {rows - 1}, past the {self.table.shape[0]} positions of autosel's rope "
                "table, while a CUDA graph is being captured, and the table cannot grow inside a capture: run the "
                "step once before capturing it (the usual warm-up), so that the table grows outside")
        self.retired.append(self.table)
        self.table = self.build(max(rows, 2 * self.table.shape[0]))
        return self.table


def rope_cache(rotary_emb, head_dim: int) -> tuple[RopeTable | None, str]:
    """The rope table for `rotary_emb`'s frequencies, first sized to its max_seq_len_cached, else why not."""
    rope_type = getattr(rotary_emb, "rope_type", None)
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        return None, f"rope_type {rope_type!r} changes its frequencies with the sequence length"
    inv_freq = getattr(rotary_emb, "inv_freq", None)
    if inv_freq is None or inv_freq.numel() * 2 != head_dim:
        return None, f"the rotary embedding does not rotate the whole head (head_dim {head_dim})"
    return RopeTable(inv_freq, rotary_emb.attention_scaling, rotary_emb.max_seq_len_cached), ""


def positions_bound(cache, layer_idx: int, tokens: int, kwargs: dict) -> int:
    """One past the largest position transformers gives a call of `tokens` tokens per sequence, read on the host
    (a device read would synchronize, and break a CUDA graph capture): what the cache holds plus the call's
    tokens; where the cache keeps that count on the device (StaticCache), all that the cache can hold. Continuous
    batching's paged cache (no get_seq_length) passes each sequence's cached-plus-new length's maximum as
    max_length_k, except on its flash decode path, where a sequence holds at most max_decode_fast_path_length."""
    if cache is None:
        return tokens
    if isinstance(kwargs.get("max_length_k"), dict):  # a PagedAttentionCache's step: one entry per layer type
        if kwargs.get("block_table") is not None:
            return cache.max_decode_fast_path_length
        return max(max(kwargs["max_length_k"].values()), tokens)
    held = cache.get_seq_length(layer_idx)
    if isinstance(held, torch.Tensor):
        return max(cache.get_max_length(layer_idx), tokens)
    return held + tokens


def fuse_gate_up(mlp, steps: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [2I, H] weight (and bias) with gate_proj's and up_proj's as views of it (no second copy is kept), so
    in-place updates of theirs (load_state_dict, add_) reach it; undo gives each its own storage back."""
    gate, up = mlp.gate_proj.weight, mlp.up_proj.weight
    weight = torch.cat((gate.data, up.data))
    gate.data, up.data = weight[:gate.shape[0]], weight[gate.shape[0]:]
    steps.append(lambda: (setattr(gate, "data", gate.data.clone()), setattr(up, "data", up.data.clone())))
    gate_bias, up_bias = mlp.gate_proj.bias, mlp.up_proj.bias
    if gate_bias is None:
        return weight, None
    bias = torch.cat((gate_bias.data, up_bias.data))  # views too: load_state_dict reaches the fused bias
    gate_bias.data, up_bias.data = bias[:gate_bias.shape[0]], bias[gate_bias.shape[0]:]
    steps.append(lambda: (setattr(gate_bias, "data", gate_bias.data.clone()),
                          setattr(up_bias, "data", up_bias.data.clone())))
    return weight, bias


# --- the replacement forwards: each reads its module's attributes per call and calls kernels resolved above ------

def rmsnorm_forward(norm, rmsnorm: Callable) -> Callable:
    def forward(hidden_states):
        return rmsnorm(hidden_states.reshape(-1, hidden_states.shape[-1]), norm.weight,
                       norm.variance_epsilon).view(hidden_states.shape)
    return forward


def layer_forward(layer, fused: Callable) -> Callable:
    """transformers' decoder layer with `residual + attention; post_attention_layernorm` as one fused kernel."""
    post = layer.post_attention_layernorm

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        # The fused kernel writes the sum in place; the layer's input belongs to the caller (and to
        # output_hidden_states), so the sum goes into a copy.
        residual = hidden_states.clone(memory_format=torch.contiguous_format)
        hidden_states, _ = layer.self_attn(
            hidden_states=layer.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, use_cache=use_cache, position_embeddings=position_embeddings,
            **kwargs)
        width = residual.shape[-1]
        fused(hidden_states.view(-1, width), residual.view(-1, width), post.weight, post.variance_epsilon)
        return residual + layer.mlp(hidden_states)
    return forward


def attention_forward(attn, rope: Callable, table: RopeTable, sliding: Callable | None, qk_norm: bool) -> Callable:
    """transformers' attention with rope applied in place on q and k in [tokens, heads * head_dim] layout, at the
    positions the model passes down (position_ids), instead of apply_rotary_pos_emb on the cos/sin it passes.

    position_ids a caller passes itself are trusted to stay below what the cache holds plus the call's tokens, as
    every position transformers computes does (from the cache's length, or from the attention mask)."""
    head_dim = attn.head_dim
    fallback = sys.modules[type(attn).__module__].eager_attention_forward

    def forward(hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, head_dim)
        query, key = attn.q_proj(hidden_states), attn.k_proj(hidden_states)
        if qk_norm:
            query, key = attn.q_norm(query.view(hidden_shape)), attn.k_norm(key.view(hidden_shape))
        value = attn.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        tokens = input_shape.numel()
        positions = kwargs["position_ids"].expand(input_shape).reshape(tokens)
        cos_sin = table.covering(positions_bound(cache, attn.layer_idx, input_shape[-1], kwargs))
        rope(positions, query.view(tokens, -1), key.view(tokens, -1), head_dim, cos_sin, True)
        query, key = query.view(hidden_shape).transpose(1, 2), key.view(hidden_shape).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, attn.layer_idx, kwargs=kwargs)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, fallback)
        window = {} if sliding is None else {"sliding_window": sliding(attn)}
        out, weights = interface(attn, query, key, value, attention_mask,
                                 dropout=0.0 if not attn.training else attn.attention_dropout,
                                 scaling=attn.scaling, **window, **kwargs)
        return attn.o_proj(out.reshape(*input_shape, -1).contiguous()), weights
    return forward


def mlp_forward(mlp, silu_and_mul: Callable, gate_up: tuple, mm: Callable | None) -> Callable:
    """down_proj(silu(gate_proj(x)) * up_proj(x)) as down_proj(silu_and_mul(x @ [gate; up].T)). Refuses to run
    once the model is training, cast, or has a new gate_proj weight: the fused weight would be stale, silently
    (no gradient reaches gate_proj and up_proj from it)."""
    weight, bias = gate_up
    gate_proj = mlp.gate_proj
    gate = gate_proj.weight

    def forward(x):
        if mlp.training or gate.dtype != weight.dtype or gate_proj.weight is not gate:
            raise IntegrationError(
                f"{type(mlp).__name__} was patched by autosel for inference with one [gate; up] weight, and since "
                f"then {'was set to training' if mlp.training else 'had its weights cast or replaced'}: call undo() "
                "on the patch's handle (model._autosel_patch) before training, .to(), or changing weights, then "
                "patch again")
        flat = x.reshape(-1, x.shape[-1])
        both = torch.nn.functional.linear(flat, weight, bias) if mm is None else mm(flat, weight)
        if mm is not None and bias is not None:
            both = both + bias
        return mlp.down_proj(silu_and_mul(both).view(*x.shape[:-1], -1))
    return forward


def linear_forward(linear, mm: Callable) -> Callable:
    def forward(x):
        out = mm(x.reshape(-1, x.shape[-1]), linear.weight).view(*x.shape[:-1], -1)
        return out if linear.bias is None else out + linear.bias
    return forward
