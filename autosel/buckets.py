"""What a call's shape bucket is: token counts rounded to buckets (token_bucket, token_bucket_up, first_tokens,
TracedTokens for what torch.compile traces), how far apart two buckets are (log_gaps, NEAREST_WITHIN), and a bucket
function's key checked before it is stored (bucket_of). The dispatcher (autosel.dispatch) routes by them, the tuner
keys its shapes by them, the built-in ops' bucket functions are made of them; their text in the DB is decisions'."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autosel.decisions import bucket_key_rule, bucket_problem, is_number
from autosel.errors import TuningError

if TYPE_CHECKING:
    from autosel.spec import OpDefinition


def token_bucket(tokens: int) -> int:
    """A token count rounded to the nearest power of two (up from 4/3 of the one below, near the geometric
    midpoint 1.41): the bucket of a call, and the token count a recorded call is tuned under. A representative
    shape at a power of two then sits inside its bucket, not at its edge. rope's bucket function inlines it."""
    tokens = int(tokens)
    return 1 << ((tokens + (tokens >> 1)).bit_length() - 1) if tokens > 1 else 1


def token_bucket_up(tokens: int) -> int:
    """A token count rounded up to a power of two: gemm.mm's bucket. A tiled kernel's time steps up where the
    count passes a multiple of its row tile (on the H200, triton's 16-row GEMM tile: 8.2-8.6 us at 11-16 tokens
    of 4096 x 4096, 13.2-13.7 us at 18-32; commit c134b65), so its buckets end at powers of two and a
    representative shape at a power of two times the bucket at its top, its slowest count."""
    tokens = int(tokens)
    return 1 << (tokens - 1).bit_length() if tokens > 1 else 1


class TracedTokens:
    """A call's token count, in a bucket key in place of its token bucket, from a bucket function's `traced`
    variant (what torch.compile traces): the traced dispatcher compares it with the edges of the runs of token
    buckets that share a winner (token_runs), so compiled code is specialised per run, not per token count.
    up: the buckets are token_bucket_up's, not token_bucket's."""

    __slots__ = ("count", "up")

    def __init__(self, count, up: bool = False) -> None:
        self.count = count
        self.up = up


def first_tokens(bucket: int, up: bool = False) -> int:
    """The least token count whose token_bucket (with up, token_bucket_up) is `bucket` (a power of two)."""
    if bucket <= 1:
        return 0
    if up:
        return bucket // 2 + 1
    tokens = -(-2 * bucket // 3)
    while tokens + (tokens >> 1) < bucket:
        tokens += 1
    while tokens > 2 and (tokens - 1) + ((tokens - 1) >> 1) >= bucket:
        tokens -= 1
    return tokens


def log_gaps(a: tuple, b: tuple) -> list[float] | None:
    """|log2(x) - log2(y)| for each numeric component of two buckets (so 2048 tokens is as far from 1024 as from
    4096); None when their lengths or any other component (a string, a bool such as is_neox) differ."""
    if len(a) != len(b):
        return None
    gaps = []
    for x, y in zip(a, b):
        if is_number(x) and is_number(y):
            gaps.append(abs(math.log2(max(x, 1)) - math.log2(max(y, 1))))
        elif x != y:
            return None
    return gaps


# How far a tuned bucket may be from an untuned one and still decide for it: within a factor of two in every
# number (log2 gap at most 1). Farther, a bucket's winner says little (on the H200, eager rmsnorm at 1500 x 6144
# tokens x hidden ran 1.8x slower on the winner of 2048 x 16384), and the op-level winner, judged on every
# shape, is the safer guess.
NEAREST_WITHIN = 1.0


def bucket_of(definition: OpDefinition, args: tuple) -> tuple:
    """definition.bucket of one call's arguments, checked to be a bucket key (decisions.bucket_problem)."""
    try:
        key = definition.bucket(*args)
    except (Exception, SystemExit, GeneratorExit) as exc:  # a bucket function's sys.exit is its failure too
        raise TuningError(f"op {definition.op!r}: its bucket function raised {type(exc).__name__}: {exc}; it takes a "
                          "call's arguments, as the kernels do, and returns a tuple") from exc
    problem = bucket_problem(key)
    if problem:
        raise TuningError(f"op {definition.op!r}: {bucket_key_rule(key, problem)}")
    return key
