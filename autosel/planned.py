"""Planned ops: kernels that are plan classes, built once per batch and run many times (OpDefinition.planned).

A planned op's backend is a class: `Plan(batch)` does every per-batch piece of work (index conversion, a vendor's
`plan()`, workspaces), once per step; `plan.run(*rest)` is then called once per layer with no further per-batch
work and no host-device synchronisation. The choice among backends is made once per plan, from the batch alone:
the op's bucket function reads the batch, and the bucket's winner's class builds the plan.

What get_kernel returns for such an op is a Planner. Everything else of autosel's (the contract, the checks, the
DB rows, the ranks' agreement) sees an ordinary kernel: calling a Planner as `planner(batch, *rest)` plans and
runs once, which is what the checks compare with the reference. Only timing differs: the tuner builds the plan
outside the timed region (prepare) and records how long that took beside the timing.

Graph mode: build a plan for each captured batch size before capture, from get_kernel(op, mode="graph"); a plan
keeps its index tensors and metadata as static buffers, so replaying the graph reads them where capture found
them. To run a new batch of the same size in a captured graph, a backend may offer `plan.update(batch)` writing
the new batch's metadata into those buffers (the torch backend does).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import Any, Callable, Mapping, Sequence

log = logging.getLogger(__name__)

# How far a planned op's batch may be from a tuned bucket and still run that bucket's winner: at any distance, the
# nearest (the least sum of log2 gaps over every number of the key, heads, head size and page size included, so a
# batch stays in its own layout's buckets unless another's are nearer overall; the dtype must match). A batch's
# numbers (batch size, KV length, spread) wander over three dimensions that a tune's few dozen batches cannot cover
# within a factor of two (buckets.NEAREST_WITHIN: 52-86% of held-out-like decode batches), and the op-level winner
# the others ran was judged mostly on other layouts and sizes. Replayed on the stored H200 and H100 tunes and held-out runs
# (dev/attention_route_whatif.py), decode's geometric mean over the per-batch best was lower or level in both modes.
PLANNED_NEAREST_WITHIN = math.inf


class UnsupportedBatch(ValueError):
    """A batch that the chosen backend cannot run (its module's supports(batch) said why) and none can stand in for."""


def supports_of(plan_class: Any) -> Callable[[Any], str | None]:
    """The `supports(batch) -> reason | None` of a plan class's module; a module without one supports every batch."""
    module = sys.modules.get(getattr(plan_class, "__module__", ""), None)
    return getattr(module, "supports", None) or (lambda batch: None)


class Planner:
    """An op's plan maker: `plan(batch)` chooses the backend for the batch (its bucket's winner) and builds its
    plan; `planner(batch, *rest)` plans and runs once (what checks and one-off calls use)."""

    __slots__ = ("op", "make_plan", "_backend_of", "_unsupported", "__weakref__")

    def __init__(self, op: str, make_plan: Callable[[Any], Any], backend_of: Callable[[Any], str | None] | None = None,
                 unsupported: Callable[[Any], str | None] | None = None) -> None:
        self.op = op
        self.make_plan = make_plan  # a plan class, or a function choosing one per batch (planner_for)
        self._backend_of = backend_of or (lambda batch: None)
        self._unsupported = unsupported or (lambda batch: None)

    def plan(self, batch: Any) -> Any:
        """The plan of `batch` on its bucket's winner; call its `run` once per layer."""
        return self.make_plan(batch)

    def __call__(self, batch: Any, *rest: Any) -> Any:
        return self.make_plan(batch).run(*rest)

    def backend_of(self, batch: Any) -> str | None:
        """The backend `plan(batch)` runs (for logs and tests), None where get_kernel did not choose it."""
        return self._backend_of(batch)

    def unsupported(self, batch: Any) -> str | None:
        """Why this planner's one backend cannot run `batch` (its module's supports), or None. The tuner leaves such
        a batch out of that candidate's checks and timing: it is ineligible there, not wrong."""
        return self._unsupported(batch)

    def __repr__(self) -> str:
        return f"<autosel Planner for {self.op} via {getattr(self.make_plan, '__qualname__', self.make_plan)!r}>"


def kernel_of(definition: Any, loaded: Any) -> Any:
    """What autosel calls as the kernel of `definition`'s op: a Planner around a planned op's plan class, else the
    loaded kernel as it is."""
    if definition is None or not getattr(definition, "planned", False) or isinstance(loaded, Planner):
        return loaded
    return Planner(definition.op, loaded, unsupported=supports_of(loaded))


def planner_for(op: str, classes: Mapping[str, Any], route: Callable[[Any], str]) -> Planner:
    """The Planner get_kernel returns: each batch's plan on route(batch)'s backend, or, where that backend's supports
    says it cannot run the batch, on the first of `classes` (eligible, in registration order: the reference first)
    that can. Never a wrong result: with none able, UnsupportedBatch with every reason."""
    supports = {backend: supports_of(cls) for backend, cls in classes.items()}

    def choose(batch: Any) -> str:
        chosen = route(batch)
        reason = supports[chosen](batch)
        if reason is None:
            return chosen
        reasons = {chosen: reason}
        for backend in classes:
            if backend not in reasons:
                reasons[backend] = supports[backend](batch)
                if reasons[backend] is None:
                    log.debug("%s: %s cannot run this batch (%s); %s plans it", op, chosen, reason, backend)
                    return backend
        raise UnsupportedBatch(f"{op}: no backend can run this batch: " +
                               "; ".join(f"{b}: {r}" for b, r in reasons.items()))

    def make_plan(batch: Any) -> Any:
        return classes[choose(batch)](batch)

    make_plan.__qualname__ = f"plan[{op}]"
    return Planner(op, make_plan, backend_of=choose)


def run_args(definition: Any, args: Sequence[Any]) -> tuple:
    """The arguments a timed call takes: a planned op's `rest` (its plan is built from args[0]), else all."""
    return tuple(args[1:]) if getattr(definition, "planned", False) else tuple(args)


def prepare(definition: Any, kernel: Callable[..., Any], args: Sequence[Any], device: str
            ) -> tuple[Callable[..., Any], tuple, float | None]:
    """(what to time, its arguments, microseconds the plan took to build or None). For a planned op the plan is
    built here, outside the timed region, between two synchronisations so that its device work counts."""
    if not getattr(definition, "planned", False):
        return kernel, tuple(args), None
    from autosel.timing import synchronize

    synchronize(device)
    began = time.perf_counter()
    plan = kernel.plan(args[0])
    synchronize(device)
    return plan.run, tuple(args[1:]), (time.perf_counter() - began) * 1e6
