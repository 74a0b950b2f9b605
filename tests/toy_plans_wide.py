"""A toy plan class whose module says it cannot run batches of 1100 elements or fewer: toy_plans_narrow's opposite."""

from toy_plans import _Plan

LIMIT = 1100


def supports(batch) -> str | None:
    return None if batch.n > LIMIT else f"n={batch.n} is not over this kernel's {LIMIT}"


class WidePlan(_Plan):
    def compute(self, x):
        return x * self.factor
