"""Many ranks, one decision: when torch.distributed is initialised, rank 0 decides and broadcasts the winner,
so every rank runs the same kernel by construction (docs/DESIGN.md section 7).

The first selection of an op with several eligible backends is then a collective: every rank must make it,
in the same order (engines select their kernels at model initialisation on every rank). It is not made
while a CUDA graph is being captured, where a collective would be recorded into the graph.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

from autosel.errors import TuningError

log = logging.getLogger(__name__)


def _world() -> tuple[int, int, object] | None:
    """(rank, world size, torch.distributed) when a process group is up with more than one rank, else None."""
    torch = sys.modules.get("torch")  # never import torch here: a process without it has no process group
    if torch is None:
        return None
    dist = getattr(torch, "distributed", None)
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    world = dist.get_world_size()
    return (dist.get_rank(), world, dist) if world > 1 else None


def agree(decide: Callable[[], str], *, what: str, in_capture: bool = False) -> str:
    """Run `decide` on rank 0 and give its answer (a backend name) to every rank; errors travel too."""
    world = None if in_capture else _world()
    if world is None:
        return decide()
    rank, size, dist = world
    message: list[object] = [None]
    if rank == 0:
        try:
            message[0] = ("ok", decide())
        except (ValueError, KeyError) as exc:  # the contract's errors (TuningError is a ValueError)
            message[0] = ("error", type(exc).__name__, str(exc.args[0] if exc.args else exc))
            dist.broadcast_object_list(message, src=0)
            raise
    dist.broadcast_object_list(message, src=0)
    kind, *payload = message[0]
    if kind == "error":
        name, text = payload
        error = KeyError if name == "KeyError" else ValueError
        raise error(f"{text} (decided on rank 0 of {size})")
    winner = payload[0]
    log.info("%s: rank %d of %d runs %r, as rank 0 decided", what, rank, size, winner)
    return winner


def check_eligible(winner: str, eligible: set[str], *, what: str) -> None:
    """Rank 0's winner must be runnable here too; ranks with different devices or packages cannot agree."""
    if winner not in eligible:
        world = _world()
        rank = world[0] if world else 0
        raise TuningError(f"{what}: rank 0 chose {winner!r}, which is not eligible on rank {rank} (eligible here: "
                          f"{sorted(eligible)}); every rank must see the same device and packages")
