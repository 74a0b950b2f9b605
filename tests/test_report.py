"""The HTML report: self-contained, log-scale inline SVG, the winner marked, reasons escaped."""

from __future__ import annotations

import re

import pytest

from autosel.decisions import CandidateResult, Decision, Measurement, ShapeResult
from autosel.inventory import Entry
from autosel.report import candidate_median_us, format_lead, format_us, render_report, svg_chart

SHAPES = [{"tokens": 1, "hidden": 4096}, {"tokens": 512, "hidden": 4096}]


def timing(median: float) -> Measurement:
    return Measurement(median_us=median, p20_us=median * 0.9, p80_us=median * 1.1, samples=10, method="fake")


def candidate(backend: str, medians: list[float] | None, status: str = "ok", reason: str | None = None):
    shapes = tuple(ShapeResult(shape=dict(s), timing=timing(m) if medians else None)
                   for s, m in zip(SHAPES, medians or [0.0] * len(SHAPES)))
    return CandidateResult(backend=backend, status=status, reason=reason, score=1.0 if medians else None,
                           shapes=shapes)


def decision(**overrides) -> Decision:
    fields = dict(
        op="layernorm.rmsnorm", mode="eager", bucket="*", winner="triton", platform_key="cpu/x86_64/test/2",
        versions={"torch": "2.13.0"}, margin=0.03, runner_up="torch", lead_over_runner_up=0.42,
        candidates=(candidate("torch", [8.0, 400.0]), candidate("triton", [5.0, 300.0]),
                    candidate("aot", None, "rejected", "max abs error 0.31 > atol 0.02 at tokens=64 <b>")),
        per_shape_winners=(('{"hidden": 4096, "tokens": 1}', "triton"), ('{"hidden": 4096, "tokens": 512}', "triton")),
        method="fake", created_at="2026-01-01T00:00:00+00:00", autosel_version="0.1.0",
    )
    fields.update(overrides)
    return Decision(**fields)


def page(*decisions: Decision, status: str = "in use") -> str:
    entries = [Entry(d, "/tmp/user.db", "user", status) for d in decisions]
    return render_report(entries, platform_facts=[("key", "cpu/x86_64/test/2"), ("versions", "torch 2.13.0")],
                         layers=[("user", "/tmp/user.db (writable, 1 rows)")], generated_at="now",
                         autosel_version="0.1.0")


def test_page_is_self_contained():
    html = page(decision())
    assert html.startswith("<!DOCTYPE html>") and "<style>" in html
    without_svg_namespace = html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert not re.search(r"<script|<link|<img|@import|url\(|https?:", without_svg_namespace)


def test_page_has_the_platform_layers_and_each_ops_evidence():
    html = page(decision(), decision(op="gemm.mm", winner="torch"))
    assert "cpu/x86_64/test/2" in html and "/tmp/user.db (writable, 1 rows)" in html
    assert html.index("gemm.mm") < html.index("layernorm.rmsnorm <span")  # ops in order
    assert "margin +42.0%" in html and "torch 2.13.0" in html
    assert html.count("<svg") == 2


def test_rejection_reasons_are_shown_and_escaped():
    html = page(decision())
    assert "max abs error 0.31 &gt; atol 0.02 at tokens=64 &lt;b&gt;" in html
    assert "<b>" not in html.split("<body>")[1].replace("<b>triton</b>", "").replace("<b>torch</b>", "")


def test_chart_is_log_scale_with_the_winner_marked():
    svg = svg_chart(decision())
    assert "log scale" in svg
    ticks = re.findall(r'class="tick">([^<]+)</text>', svg)
    for label in ("1 µs", "10 µs", "100 µs", "1 ms"):
        assert label in ticks
    assert "triton ★ winner" in svg
    # the winner's line is drawn thicker than the others, and last (on top)
    widths = re.findall(r'<polyline points="[^"]+" fill="none" stroke="[^"]+" stroke-width="([\d.]+)"', svg)
    assert widths == ["1.6", "3.5"]
    assert "chosen at this shape" in svg and "triton at tokens=512, hidden=4096: median 300 µs" in svg


def test_the_margin_line_names_the_timing_methods_floor():
    html = page(decision(method="cuda:back-to-back", margin=0.1))
    assert "10.0%: to rule a candidate out" in html and "never below 10% for cuda:back-to-back" in html
    assert "never below 3% for fake" in page(decision())


def test_an_eager_cuda_point_shows_its_host_and_device_parts():
    import dataclasses

    split = dataclasses.replace(timing(30.0), host_us=29.0, device_us=4.0)
    triton = dataclasses.replace(candidate("triton", [5.0, 300.0]), shapes=(
        ShapeResult(shape=dict(SHAPES[0]), timing=split), ShapeResult(shape=dict(SHAPES[1]), timing=timing(300.0))))
    svg = svg_chart(decision(candidates=(candidate("torch", [8.0, 400.0]), triton)))
    assert "median 30 µs (p20 27 µs, p80 33 µs, 10 samples); host 29 µs, device 4 µs per call" in svg
    assert svg.count("µs per call") == 1  # the points without the split say nothing of it


def test_rejected_candidates_are_not_plotted():
    svg = svg_chart(decision())
    assert "aot" not in svg


def test_dropped_candidate_is_dashed_and_labelled():
    d = decision(candidates=(candidate("torch", [80.0, 4000.0], "dropped", "dropped after the first round"),
                             candidate("triton", [5.0, 300.0])))
    svg = svg_chart(d)
    assert 'stroke-dasharray="6,4"' in svg and "torch (dropped)" in svg


def test_no_timings_says_so_instead_of_an_empty_plot():
    d = decision(candidates=(candidate("torch", None, "rejected", "raised"),))
    assert svg_chart(d) == '<p class="muted">No candidate was timed, so there is nothing to plot.</p>'


def test_per_shape_winners_table():
    html = page(decision())
    assert "<code>tokens=1, hidden=4096</code></td><td>triton</td>" in html


def test_stale_entries_are_badged():
    assert '<span class="badge stale">stale</span>' in page(decision(), status="stale")


@pytest.mark.parametrize("value, text", [(0.5, "0.5 µs"), (12.34, "12.3 µs"), (2500.0, "2.5 ms"),
                                         (3.2e6, "3.2 s"), (None, "-")])
def test_format_us(value, text):
    assert format_us(value) == text


def test_candidate_median_is_the_geomean_of_per_shape_medians():
    assert candidate_median_us(candidate("torch", [8.0, 200.0])) == pytest.approx(40.0)
    assert candidate_median_us(candidate("aot", None)) is None


def test_compile_time_is_reported_apart_from_the_timed_medians():
    compiled = CandidateResult(backend="torch_compile", status="ok", score=1.0, shapes=(
        ShapeResult(shape=dict(SHAPES[0]), timing=timing(4.0), first_call_s=21.3),
        ShapeResult(shape=dict(SHAPES[1]), timing=timing(200.0), first_call_s=0.004)))
    html = page(decision(candidates=decision().candidates + (compiled,)))
    assert "first call (with compile)" in html and "21.30 s" in html
    assert candidate_median_us(compiled) == pytest.approx((4.0 * 200.0) ** 0.5)


def kept_default() -> Decision:
    """torch kept as the default although triton's medians are lower: triton did not win by more than the noise."""
    return decision(winner="torch", runner_up="triton", lead_over_runner_up=-0.187,
                    per_shape_winners=(('{"hidden": 4096, "tokens": 1}', "torch"),
                                       ('{"hidden": 4096, "tokens": 512}', "torch")))


def test_a_faster_runner_up_is_said_in_words_not_as_a_negative_margin():
    # "torch chosen, runner-up torch_compile (margin -18.7%)" read as a bug.
    assert format_lead(kept_default()) == "default kept: runner-up 18.7% faster, not beyond the noise in every round"
    assert format_lead(decision()) == "+42.0%"
    html = page(kept_default())
    assert "triton (18.7% faster than torch overall, but not by more than the noise in every round, so the " \
           "default, torch, was kept)" in html
    assert "-18.7%" not in html


def test_per_shape_table_bolds_the_fastest_and_marks_the_chosen_apart():
    # The table bolded the chosen backend, so a kept default looked fastest; the README says the fastest is marked.
    html = page(kept_default())
    row = re.search(r"<code>tokens=1, hidden=4096</code>.*?</tr>", html).group(0)
    assert '<td class="num">8 µs <span class="chosen" title="chosen at this shape">✓</span></td>' in row
    assert '<td class="num winner">5 µs</td>' in row
    svg = svg_chart(kept_default())
    assert re.search(r'r="6" fill="[^"]+" stroke="#111" stroke-width="2"><title>triton at tokens=1', svg)
    assert "fastest at that shape" in svg


def test_shapes_are_plotted_from_the_smallest_to_the_largest():
    # Shapes were plotted in declaration order, so the lines zig-zagged.
    big_first = [dict(SHAPES[1]), dict(SHAPES[0])]
    flipped = [CandidateResult(c.backend, c.status, c.reason, c.score,
                               tuple(ShapeResult(shape=s, timing=r.timing) for s, r in zip(big_first, c.shapes[::-1])))
               for c in decision().candidates]
    svg = svg_chart(decision(candidates=tuple(flipped)))
    labels = [t for t in re.findall(r'class="tick">([^<]+)</text>', svg) if "×" in t]
    assert labels == ["1×4096", "512×4096"]
    html = page(decision(candidates=tuple(flipped)))
    assert html.index("<code>tokens=1, hidden=4096") < html.index("<code>tokens=512, hidden=4096")
