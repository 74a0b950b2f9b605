"""CPU kernels for one toy op with really different speeds: a slow reference, a fast one, a wrong-but-fast one,
one that raises and one that returns NaN. Importable by target string ("toy_kernels:fast")."""

import os

import torch

if os.environ.get("TOY_KERNELS_FAIL_IMPORT"):  # for a child process whose op functions cannot load
    raise ImportError("toy_kernels refuses to load in this process")

SIZE = 1 << 16


def slow(x: torch.Tensor) -> torch.Tensor:
    y = x
    for _ in range(64):  # the same answer, computed 64 times
        y = x * 2
    return y


def fast(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def wrong_but_fast(x: torch.Tensor) -> torch.Tensor:
    return x  # skips the work: the fastest of all, and wrong


def raises(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("illegal memory access (simulated)")


def nan(x: torch.Tensor) -> torch.Tensor:
    return x * float("nan")


def inputs(shape: dict, device: str) -> tuple:
    return (torch.randn(shape["n"], device=device),)


def with_weight(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x * 2, with a second argument of one shape for every call: a route_key that cannot tell calls apart."""
    return x * 2


def inputs_with_weight(shape: dict, device: str) -> tuple:
    return torch.randn(shape["n"], device=device), torch.ones(3, device=device)


SHAPES = [{"n": SIZE}, {"n": SIZE // 4}]


def add_in_place(x: torch.Tensor, y: torch.Tensor) -> None:
    """An in-place op's reference: x <- x + y."""
    x.add_(y)


def add_in_place_returning(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x.add_(y)  # idiomatic torch: the in-place method returns the tensor it wrote


def add_in_place_zeroing_y(x: torch.Tensor, y: torch.Tensor) -> None:
    x.add_(y)
    y.zero_()


def two_inputs(shape: dict, device: str) -> tuple:
    return torch.randn(shape["n"], device=device), torch.randn(shape["n"], device=device)


def broken_inputs(shape: dict, device: str) -> tuple:
    raise RuntimeError("input factory failed (simulated)")


def segfaults(x: torch.Tensor) -> torch.Tensor:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a kernel with a bad pointer would
    return x


def doubles_in_place(x: torch.Tensor) -> torch.Tensor:
    return x.mul_(2)  # the right values, written over the caller's input


def doubles_and_counts_in_input(x: torch.Tensor) -> torch.Tensor:
    """A reference with a side effect: returns x * 2 and writes x + 1 over its input."""
    y = x * 2
    x.add_(1)
    return y


def interrupted(x: torch.Tensor) -> torch.Tensor:
    raise KeyboardInterrupt  # what Ctrl-C raises in a process running this kernel


def hangs(x: torch.Tensor) -> torch.Tensor:
    import time

    time.sleep(3600)
    return x


_compiled: set = set()


def compiles_first(x: torch.Tensor) -> torch.Tensor:
    """Like a JIT-compiled kernel: the first call is slow (compilation), the rest are fast."""
    import time

    if not _compiled:
        time.sleep(0.5)
        _compiled.add(True)
    return x * 2


SEEN: list = []


def records_inputs(x: torch.Tensor) -> torch.Tensor:
    """fast, noting which input tensor it was given."""
    SEEN.append(x.data_ptr())
    return x * 2


def use_fresh_registry() -> list:
    """For a child process: a fresh registry in the selector holding toy.double (slow torch, fast "triton"),
    and a list that grows by one each time the tuner runs."""
    import autosel.tuner
    from autosel import batch, distributed, selector, tuning
    from autosel.registry import KernelRegistry
    from autosel.spec import KernelBackend, KernelSpec, OpDefinition

    registry = selector.registry = tuning.registry = distributed.registry = batch.registry = KernelRegistry()
    registry.register(KernelSpec("toy.double", KernelBackend.TORCH, "toy_kernels:slow"))
    registry.register(KernelSpec("toy.double", KernelBackend.TRITON, "toy_kernels:fast"))
    registry.define(OpDefinition("toy.double", shapes=SHAPES, make_inputs=inputs))
    timed: list = []
    original = autosel.tuner.Tuner.tune_buckets
    autosel.tuner.Tuner.tune_buckets = lambda self, *a, **k: timed.append(1) or original(self, *a, **k)
    return timed


def plant(op: str, default: str, winners: dict[tuple, str]) -> None:
    """Store a decision for `op` (eager mode) in this process's user DB as if a tune had chosen `default` at op
    level and `winners` per bucket: a rank whose own DB disagrees with rank 0's."""
    from autosel import config, platforms, selector, tuning
    from autosel.decisions import Decision, bucket_text

    platform = platforms.current_platform()
    eligible = [s for s in selector.registry.get(op) if s.is_available(platform)]
    key = tuning.decision_key(op, eligible, platform, "eager")
    row = Decision(op=op, mode="eager", bucket=key.bucket, winner=default, platform_key=platform.key,
                   versions=platforms.version_vector(platform, eligible), candidates=(), margin=0.0, method="planted")
    buckets = [Decision(**{**vars(row), "bucket": bucket_text(k), "winner": w}) for k, w in winners.items()]
    tuning.database(config.settings()).record(row, buckets)


def overhead(x: torch.Tensor) -> torch.Tensor:
    """x * 2 after a fixed 2 ms: far slower than `slow` on tiny inputs, far faster on 1 << 20 elements."""
    import time

    time.sleep(0.002)
    RAN.append(x.numel())
    return x * 2


RAN: list = []  # the sizes `overhead` ran on


def bucket(x: torch.Tensor) -> tuple:
    """The element count rounded up to a power of two."""
    n = x.numel()
    return (1 << (n - 1).bit_length() if n > 1 else 1,)


# `slow` wins the first (about 0.1 ms against 2), `overhead` the second (2 ms against about 10): 4x apart or more,
# so a busy machine cannot turn either.
SPLIT_SHAPES = [{"n": 16}, {"n": 1 << 20}]


def exits(x: torch.Tensor) -> torch.Tensor:
    import sys

    sys.exit(0)  # a kernel that ends the process "successfully"


def exits_hard(x: torch.Tensor) -> torch.Tensor:
    import os

    os._exit(0)  # no cleanup, no exception to catch


def chatty(x: torch.Tensor) -> torch.Tensor:
    import sys

    sys.stdout.write("debug: no newline")  # a kernel's own output on stdout
    sys.stdout.flush()
    return x * 2


def chatty_fd(x: torch.Tensor) -> torch.Tensor:
    os.write(1, b"debug: from C\n")  # to the file descriptor, as a C library's printf does
    return x * 2


nan_later_calls: list = []


def nan_after_its_first_calls(x: torch.Tensor) -> torch.Tensor:
    """Right at its first two calls (the check before timing), NaN from the third on (its timed calls)."""
    nan_later_calls.append(1)
    return x * 2 if len(nan_later_calls) <= 2 else x * float("nan")


_calls: list = []


def segfaults_from_the_4th_call(x: torch.Tensor) -> torch.Tensor:
    """Correct for three calls (the check's), then a crash, as a kernel with a growing workspace might."""
    _calls.append(1)
    if len(_calls) >= 4:
        import ctypes

        ctypes.string_at(0)
    return x * 2


def _rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


# An rmsnorm that torch.compile cannot trace, as flashinfer's and sgl-kernel's calls on a GPU.
untraceable_rmsnorm = torch._dynamo.disable(_rmsnorm)


# An op whose first argument is an activation of 16 MB that the kernels barely read: the time of writing it before
# each call dwarfs theirs. head_in_place counts the calls that found x as made (graph-mode timing writes it first).
CALLS_ON_X_AS_MADE: list[bool] = []


def big_activation(shape: dict, device: str) -> tuple:
    return torch.zeros(4 << 20, device=device), torch.randn(8, device=device)


def head_in_place(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    CALLS_ON_X_AS_MADE.append(bool(x[0] == 0))
    x[0] += 1
    return y * 2
