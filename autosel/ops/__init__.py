"""autosel's built-in ops, registered through the `autosel.ops` entry point like any third-party package's.

Importing this package imports no torch: kernels are named by "module:attr" and loaded on first use.
"""

from __future__ import annotations

from autosel.ops import activation, attention, embeddings, gemm, layernorm
from autosel.registry import KernelRegistry, registry

GROUPS = (layernorm, activation, embeddings, gemm, attention)


def register_builtin_ops(into: KernelRegistry | None = None) -> None:
    """Register every built-in spec and op definition (idempotent: identical registrations are no-ops)."""
    target = into if into is not None else registry
    for group in GROUPS:
        for spec in group.SPECS:
            target.register(spec)
        for definition in group.DEFINITIONS:
            target.define(definition)
