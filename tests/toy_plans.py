"""Plan classes of one toy planned op (x * the batch's factor), importable by target ("toy_plans:FastPlan"): a slow
reference, a fast one, and counters that tell how many plans were built and run."""

from dataclasses import dataclass

import torch

built: dict[str, int] = {}  # plan class name -> plans built
ran: dict[str, int] = {}  # plan class name -> runs


@dataclass(frozen=True, eq=False)
class ToyBatch:
    n: int
    factor: float = 2.0


class _Plan:
    def __init__(self, batch: ToyBatch) -> None:
        built[type(self).__name__] = built.get(type(self).__name__, 0) + 1
        self.factor = torch.tensor(batch.factor)

    def run(self, x: torch.Tensor) -> torch.Tensor:
        ran[type(self).__name__] = ran.get(type(self).__name__, 0) + 1
        return self.compute(x)


class SlowPlan(_Plan):
    def compute(self, x):
        y = x
        for _ in range(16):
            y = x * self.factor
        return y


class FastPlan(_Plan):
    def compute(self, x):
        return x * self.factor


class WrongPlan(_Plan):
    def compute(self, x):
        return x


def inputs(shape: dict, device: str) -> tuple:
    return (ToyBatch(shape["n"]), torch.randn(shape["n"], device=device))


def bucket(batch: ToyBatch, *rest) -> tuple:
    return (batch.n,)


def shape_of(batch: ToyBatch, *rest) -> dict:
    return {"n": batch.n}


SHAPES = [{"n": 1024}, {"n": 4096}]
