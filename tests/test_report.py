"""The HTML report (autosel/report.py) and its plot (autosel/chart.py): self-contained, log-scale inline SVG, the
winner marked, reasons escaped."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from autosel.decisions import CandidateResult, Decision, Measurement, ShapeResult, bucket_text
from autosel.inventory import Entry
from autosel.chart import svg_chart
from autosel.formatting import format_lead, format_us
from autosel.report import candidate_median_us, render_report, sections

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


def page(*decisions: Decision, status: str = "in use", entries: list[Entry] | None = None) -> str:
    entries = entries or [Entry(d, "/tmp/user.db", "user", status) for d in decisions]
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
    assert "get_kernel runs it at this shape" in svg and "triton at tokens=512, hidden=4096: median 300 µs" in svg


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
    assert '<td class="num">8 µs <span class="chosen" title="get_kernel runs it at this shape">✓</span></td>' in row
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


# --- shape buckets ----------------------------------------------------------------------------------------

TOKENS = (1, 16, 512, 4096)  # hidden 4096 throughout; declared out of order below, plotted in this order


def on_shapes(backend: str, medians: dict[int, float]) -> CandidateResult:
    """A candidate timed at the shapes tokens x 4096 for each tokens count in `medians` (in the dict's order)."""
    shapes = tuple(ShapeResult(shape={"tokens": t, "hidden": 4096}, timing=timing(m)) for t, m in medians.items())
    return CandidateResult(backend=backend, status="ok", score=1.0, shapes=shapes)


TORCH = {512: 300.0, 1: 4.0, 4096: 2000.0, 16: 6.0}
TRITON = {512: 200.0, 1: 5.0, 4096: 1500.0, 16: 8.0}


def bucketed(assignment: dict[int, tuple]) -> tuple[Decision, list[Decision]]:
    """The op-level row over every shape (triton wins) and one row per bucket in `assignment` (tokens -> bucket
    key), each with its own shapes' evidence; a bucket wins with torch when torch is faster at all its shapes."""
    op_level = decision(candidates=(on_shapes("torch", TORCH), on_shapes("triton", TRITON)))
    rows = []
    for key in dict.fromkeys(assignment.values()):
        tokens = [t for t, k in assignment.items() if k == key]
        torch, triton = ({t: m[t] for t in tokens} for m in (TORCH, TRITON))
        winner = "torch" if all(torch[t] < triton[t] for t in tokens) else "triton"
        rows.append(decision(bucket=bucket_text(key), winner=winner, runner_up=({"torch", "triton"} - {winner}).pop(),
                             candidates=(on_shapes("torch", torch), on_shapes("triton", triton))))
    return op_level, rows


THREE_BUCKETS = {1: (16, 4096), 16: (16, 4096), 512: (512, 4096), 4096: (4096, 4096)}


def test_an_op_with_buckets_is_one_section_with_a_per_bucket_winners_table():
    # Each bucket row used to become a section of its own, with its own plot.
    op_level, rows = bucketed(THREE_BUCKETS)
    html = page(op_level, *rows[::-1])
    assert html.count('<section class="op">') == 1 and html.count("<svg") == 1
    table = html.split("<h3>Per-bucket winners</h3>")[1].split("</table>")[0]
    assert re.findall(r"<tr><td><code>([^<]+)</code></td><td[^>]*>(\w+)</td>", table) == [
        ("[16, 4096]", "torch"), ("[512, 4096]", "triton"), ("[4096, 4096]", "triton")]
    assert ("<td><code>tokens=1, hidden=4096</code><br><code>tokens=16, hidden=4096</code></td>"
            '<td class="winner">another winner</td>') in table
    assert table.count("<td>same</td>") == 2 and "torch (+42.0%)" in table
    assert "layernorm.rmsnorm (eager): <b>triton</b> (1 of 3 buckets run another winner)" in html


def test_the_table_of_contents_says_when_every_bucket_runs_the_op_level_winner():
    op_level, rows = bucketed({512: (512, 4096), 4096: (4096, 4096)})  # triton is faster at both
    assert "<b>triton</b> <span class=\"muted\">(all 2 buckets run it)</span>" in page(op_level, *rows)


@pytest.mark.parametrize("assignment, separators, switches, labels", [
    (THREE_BUCKETS, 2, 1, ["torch", "triton"]),  # one label over the two triton buckets
    ({1: (1, 4096), 16: (1, 4096), 512: (1, 4096), 4096: (1, 4096)}, 0, 0, ["triton"]),  # one bucket: no boundary
    ({1: ("a",), 16: ("b",), 512: ("a",), 4096: ("b",)}, 3, 0, ["triton"]),  # interleaved along the x axis
    ({1: (16, 4096), 16: (16, 4096)}, 1, 1, ["torch"]),  # the larger shapes in no bucket row: a boundary, no label
])
def test_bucket_boundaries_are_marked_between_stretches_of_different_buckets(assignment, separators, switches, labels):
    op_level, rows = bucketed(assignment)
    svg = svg_chart(op_level, buckets=rows)
    assert len(re.findall(r'class="bucket-sep[ "]', svg)) == separators
    assert svg.count('class="bucket-sep switch"') == switches  # drawn darker: the dispatcher changes backend there
    assert re.findall(r'<text class="bucket"[^>]*>→ (\w+)<title>', svg) == labels
    assert "bucket boundary" in svg


def test_a_bucket_label_names_its_buckets_and_the_op_level_winner():
    op_level, rows = bucketed(THREE_BUCKETS)
    svg = svg_chart(op_level, buckets=rows)
    assert "<title>bucket [16, 4096]: calls there run torch (op-level winner triton)</title>" in svg
    assert "<title>buckets [512, 4096], [4096, 4096]: calls there run triton (the op-level winner)</title>" in svg


def test_an_op_without_buckets_has_no_bucket_marks():
    op_level, _ = bucketed(THREE_BUCKETS)
    for svg in (svg_chart(op_level), svg_chart(decision()), page(decision())):
        assert "bucket-sep" not in svg and 'class="bucket"' not in svg and "bucket boundary" not in svg
    assert "Per-bucket winners" not in page(decision())
    assert svg_chart(op_level, buckets=()) == svg_chart(op_level)


def test_bucket_rows_without_their_op_level_row_are_shown_not_dropped():
    op_level, rows = bucketed(THREE_BUCKETS)
    shipped = [Entry(d, "/opt/shipped.db", "shipped", "stale", "tuned on gpu/sm_90") for d in rows]
    html = page(entries=[Entry(op_level, "/tmp/user.db", "user", "in use"), *shipped])  # another layer: another tune
    assert html.count('<section class="op">') == 2 and html.count("<svg") == 1
    orphan = html.split('<section class="op">')[2]
    assert orphan.count("<tr><td><code>") == 3 and "/opt/shipped.db" in orphan and "tuned on gpu/sm_90" in orphan
    assert ("<li>layernorm.rmsnorm (eager): bucket rows only (3, no op-level row) "
            '<span class="badge stale">stale</span></li>') in html
    alone = page(entries=shipped)
    assert alone.count('<section class="op">') == 1 and "<svg" not in alone and alone.count("<tr><td><code>[") == 3


def test_bucket_text_is_escaped():
    op_level, rows = bucketed({1: ("<b>", True), 16: ("<b>", True)})
    html = page(op_level, *rows)
    assert '<code>[&quot;&lt;b&gt;&quot;, true]</code>' in html and '["<b>"' not in html


def test_sections_keep_layer_order_and_put_bucket_rows_beside_their_tune():
    op_level, rows = bucketed(THREE_BUCKETS)
    user = [Entry(d, "/tmp/user.db", "user", "in use") for d in (op_level, *rows)]
    shadowed = Entry(op_level, "/opt/shipped.db", "shipped", "shadowed")
    [first, second] = sections([shadowed, *user[::-1]])
    assert first.entry == user[0] and [b.decision.bucket for b in first.buckets] == [
        "[16, 4096]", "[512, 4096]", "[4096, 4096]"]
    assert second.entry == shadowed and second.buckets == () and first.differ == 1


def test_the_per_shape_tick_is_what_get_kernel_runs_there_not_the_stored_per_shape_verdict():
    # The per-shape verdict falls back to the first-registered backend, a bucket to the op-level winner: on the
    # shipped H200 DB the page ticked triton at 23 shapes whose bucket ran flashinfer.
    op_level = replace(kept_default(), winner="triton", per_shape_winners=(
        ('{"hidden": 4096, "tokens": 1}', "torch"), ('{"hidden": 4096, "tokens": 512}', "torch")))
    small = replace(op_level, bucket="[1, 4096]", winner="torch", candidates=tuple(
        replace(c, shapes=c.shapes[:1]) for c in op_level.candidates))
    big = replace(op_level, bucket="[512, 4096]", winner="triton", candidates=tuple(
        replace(c, shapes=c.shapes[1:]) for c in op_level.candidates))
    from autosel.report import _per_shape_table

    table = _per_shape_table(op_level, [small, big])
    rows = {shape: re.search(rf"<code>{shape}</code></td><td>(\w+)</td>", table).group(1)
            for shape in ("tokens=1, hidden=4096", "tokens=512, hidden=4096")}
    assert rows == {"tokens=1, hidden=4096": "torch", "tokens=512, hidden=4096": "triton"}
    assert "get_kernel runs it at this shape" in svg_chart(op_level, buckets=[small, big]).split(
        "triton at tokens=512")[1].split("</title>")[0]
