"""tools/stability_whatif.py --settled: stored evidence cut back to what the tuner, settling pairs, would have timed."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from autosel.decisions import Measurement

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def whatif():
    sys.path.insert(0, str(TOOLS))  # the tool imports stability_bench, beside it
    try:
        yield importlib.import_module("stability_whatif")
    finally:
        sys.path.remove(str(TOOLS))


def _m(rounds):
    return Measurement(median_us=rounds[0], p20_us=rounds[0], p80_us=rounds[0], samples=45, method="cuda:graph-replay",
                       round_medians_us=tuple(rounds))


def test_a_pair_far_behind_after_round_one_keeps_that_round_only(whatif):
    stats = {"a": [_m((10.0, 10.0, 10.0))], "b": [_m((20.0, 19.0, 21.0))], "c": [_m((12.0, 12.5, 11.0))]}
    cut = whatif.settled(stats, 1.3)
    assert cut["b"][0].round_medians_us == (20.0,)  # 2x behind a
    assert cut["a"][0].round_medians_us == (10.0, 10.0, 10.0) and cut["c"][0].round_medians_us == (12.0, 12.5, 11.0)
    assert stats["b"][0].round_medians_us == (20.0, 19.0, 21.0)  # the stored evidence is not changed


def test_a_shape_with_one_candidate_left_keeps_round_one_for_every_candidate(whatif):
    stats = {"a": [_m((10.0, 10.0, 10.0))], "b": [_m((20.0, 19.0, 21.0))]}
    cut = whatif.settled(stats, 1.3)
    assert [cut[b][0].round_medians_us for b in "ab"] == [(10.0,), (20.0,)]
