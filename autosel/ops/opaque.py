"""The built-in ops' kernels as torch.compile sees them: one torch custom op per (op, backend) around the kernel,
with a fake implementation that gives its output's shape, so compiled code calls the kernel as one node.

On the H200 (commit 0dde738) compiled code could not call them as they are: flashinfer's calls cannot
be traced (a graph break each, and `fullgraph=True` failed), and autosel's Triton wrappers were traced and compiled
again for every token count (`fullgraph=True` failed at the ninth, on the recompile limit). sgl-kernel's are wrapped
alike, and so are the torch_compile backend's: a function torch.compile made is not traced by an outer compile (a
graph break; a patched model under `fullgraph=True` failed on this CPU). Every kernel of every op, compiled with
`fullgraph=True` over four token counts, ran in at most two graphs and matched its eager calls on the H200
(tests/gpu/test_ops_gpu.py).
The torch backend is torch code that torch.compile traces and fuses: it is left as it is.

Eager calls never go through these ops (a custom op call costs microseconds of host time); only traced code does,
through autosel.dispatch.trace_as.
"""

from __future__ import annotations

from typing import Callable

import torch

from autosel import state

TRACED_AS_THEY_ARE = ("torch",)
# id(kernel) -> its custom op (a kernel is a module's function, kept alive by it). Not in autosel.state: torch keeps
# every op defined for the process, so neither clear_cache nor a test can forget one and define its name again.
_made: dict[int, Callable] = {}


def _opaque(op: str, backend: str, kernel: Callable, define: Callable[[str, Callable], Callable]) -> Callable:
    if backend in TRACED_AS_THEY_ARE:
        return kernel
    with state.process.locks.custom_ops:  # threads resolving one op at once defined one name twice: torch refused
        if id(kernel) not in _made:  # a custom op's name is registered once per process
            name = f"{op.replace('.', '_')}_{backend}_{len(_made)}"
            define(f"autosel::{name}", kernel)
            _made[id(kernel)] = getattr(torch.ops.autosel, name).default  # an OpOverload: what a graph holds
        return _made[id(kernel)]


def rmsnorm(backend: str, kernel: Callable) -> Callable:
    def define(name, kernel):
        @torch.library.custom_op(name, mutates_args=())
        def call(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return kernel(x, weight, eps).contiguous()  # as the fake says: some kernels keep x's layout

        call.register_fake(lambda x, weight, eps: torch.empty_like(x, memory_format=torch.contiguous_format))

    return _opaque("layernorm.rmsnorm", backend, kernel, define)


def fused_add_rmsnorm(backend: str, kernel: Callable) -> Callable:
    def define(name, kernel):
        @torch.library.custom_op(name, mutates_args=("x", "residual"))
        def call(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
            kernel(x, residual, weight, eps)

        call.register_fake(lambda x, residual, weight, eps: None)

    return _opaque("layernorm.fused_add_rmsnorm", backend, kernel, define)


def _gated(op: str) -> Callable[[str, Callable], Callable]:
    def opaque(backend: str, kernel: Callable) -> Callable:
        def define(name, kernel):
            @torch.library.custom_op(name, mutates_args=())
            def call(x: torch.Tensor) -> torch.Tensor:
                return kernel(x).contiguous()

            call.register_fake(lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)))

        return _opaque(op, backend, kernel, define)
    return opaque


silu_and_mul = _gated("activation.silu_and_mul")
gelu_and_mul = _gated("activation.gelu_and_mul")


def rope(backend: str, kernel: Callable) -> Callable:
    def define(name, kernel):
        @torch.library.custom_op(name, mutates_args=("query", "key"))
        def call(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int,
                 cos_sin_cache: torch.Tensor, is_neox: bool) -> None:
            kernel(positions, query, key, head_size, cos_sin_cache, is_neox)

        call.register_fake(lambda positions, query, key, head_size, cos_sin_cache, is_neox: None)

    return _opaque("embeddings.rope", backend, kernel, define)


def mm(backend: str, kernel: Callable) -> Callable:
    def define(name, kernel):
        @torch.library.custom_op(name, mutates_args=())
        def call(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return kernel(a, b).contiguous()

        call.register_fake(lambda a, b: a.new_empty((*a.shape[:-1], b.shape[0])))

    return _opaque("gemm.mm", backend, kernel, define)
