"""A toy plan class whose module says it cannot run batches over 1100 elements (supports), as a vendor kernel
refuses a head_dim or page size."""

from toy_plans import _Plan

LIMIT = 1100


def supports(batch) -> str | None:
    return None if batch.n <= LIMIT else f"n={batch.n} is over this kernel's {LIMIT}"


class NarrowPlan(_Plan):
    def compute(self, x):
        return x * self.factor
