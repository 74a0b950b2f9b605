"""A toy plan class whose module says it cannot run batches over 1100 elements (supports), as a vendor kernel
refuses a head_dim or page size; planning such a batch anyway raises, as the vendor's plan() would."""

from toy_plans import _Plan

LIMIT = 1100


def supports(batch) -> str | None:
    return None if batch.n <= LIMIT else f"n={batch.n} is over this kernel's {LIMIT}"


class NarrowPlan(_Plan):
    def __init__(self, batch) -> None:
        if batch.n > LIMIT:
            raise RuntimeError(f"NarrowPlan planned for n={batch.n} (simulated kernel failure)")
        super().__init__(batch)

    def compute(self, x):
        return x * self.factor
