"""The HTML report of tuning decisions: one self-contained page, plots drawn as inline SVG (no JS, no network)."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Iterable, Sequence

from autosel.chart import bucket_shapes, fastest_at, runs_at, shape_order, svg_chart
from autosel.decisions import OP_LEVEL_BUCKET, CandidateResult, Decision, bucket_order
from autosel.formatting import format_lead, format_us, shape_text
from autosel.inventory import Entry
from autosel.policy import geomean, rule_for

# --- numbers ----------------------------------------------------------------------------------------------

def candidate_median_us(candidate: CandidateResult | None) -> float | None:
    """Geometric mean over the shapes of the candidate's per-shape median time; None if it was never timed."""
    if candidate is None:
        return None
    medians = [s.timing.median_us for s in candidate.shapes if s.timing is not None and s.timing.median_us > 0]
    return geomean(medians) if medians else None


def plan_us(candidate: CandidateResult | None) -> float | None:
    """A planned op's plan-building time, the geometric mean over the shapes (built outside the timed calls, once
    per batch: a step pays it once, its layers' runs each pay the median); None for other ops."""
    values = [s.plan_us for s in (candidate.shapes if candidate else ()) if s.plan_us is not None and s.plan_us > 0]
    return geomean(values) if values else None


def first_call_s(candidate: CandidateResult | None) -> float | None:
    """The longest first call over the shapes: it includes compilation (torch.compile, Triton JIT), which the
    check absorbs before timing and which is reported here, separately from the timed medians."""
    values = [s.first_call_s for s in (candidate.shapes if candidate else ()) if s.first_call_s is not None]
    return max(values) if values else None


# --- which rows make a section ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Section:
    """One section of the page: an op-level row with the bucket rows of the same tune (same platform, op, mode,
    versions and layer, as the dispatcher reads them), or, when no op-level row of that tune is among the rows
    shown, its bucket rows alone (entry None)."""

    entry: Entry | None
    buckets: tuple[Entry, ...] = ()

    @property
    def first(self) -> Entry:
        return self.entry if self.entry is not None else self.buckets[0]

    @property
    def differ(self) -> int:
        """How many buckets run another backend than the op-level winner."""
        if self.entry is None:
            return 0
        return sum(b.decision.winner != self.entry.decision.winner for b in self.buckets)


def _tune_of(entry: Entry) -> tuple:
    key = entry.decision.key
    return (key.platform_key, key.op, key.mode, key.versions_hash, entry.layer_path)


def sections(entries: Iterable[Entry]) -> list[Section]:
    """The rows grouped into sections, by op and mode, the rows in use first; bucket rows sit in their op-level
    row's section, in bucket order, and bucket rows whose op-level row is not among `entries` get one section
    per tune after the op's others, so that none is left out."""
    entries = list(entries)
    buckets: dict[tuple, list[Entry]] = {}
    for e in entries:
        if e.decision.bucket != OP_LEVEL_BUCKET:
            buckets.setdefault(_tune_of(e), []).append(e)
    for rows in buckets.values():
        rows.sort(key=lambda e: bucket_order(e.decision.bucket))
    out, placed = [], set()
    for e in entries:
        if e.decision.bucket == OP_LEVEL_BUCKET:
            tune = _tune_of(e)  # one op-level row per tune in a real layer; a second one gets its section, bare
            out.append(Section(e, () if tune in placed else tuple(buckets.get(tune, ()))))
            placed.add(tune)
    out += [Section(None, tuple(rows)) for tune, rows in buckets.items() if tune not in placed]
    return sorted(out, key=lambda s: (s.first.decision.op, s.first.decision.mode, s.entry is None,
                                      s.first.status != "in use"))


# --- the page ---------------------------------------------------------------------------------------------

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #222; margin: 0; }
main { max-width: 1140px; margin: 0 auto; padding: 20px 28px 48px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 18px; margin: 28px 0 6px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
section.op { border-top: 2px solid #ddd; margin-top: 26px; padding-top: 4px; }
table { border-collapse: collapse; margin: 6px 0 10px; }
th, td { border-bottom: 1px solid #e5e5e5; padding: 3px 10px 3px 0; text-align: left; vertical-align: top; }
th { font-weight: 600; color: #555; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.muted { color: #777; } .winner { font-weight: 700; } .chosen { color: #2a6a2a; }
.badge { display: inline-block; padding: 0 7px; border-radius: 9px; font-size: 12px; background: #e8e8e8; }
.badge.in-use { background: #d8f0d8; } .badge.stale, .badge.unusable { background: #f6dcdc; }
.badge.shadowed { background: #eee; } .reason { color: #8a2a2a; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 2px 14px; margin: 6px 0; }
dl.facts dt { color: #555; } dl.facts dd { margin: 0; }
svg text.tick { font-size: 11px; fill: #555; } svg text.axis { font-size: 12px; fill: #333; }
svg text.legend { font-size: 12px; fill: #222; } svg text.bucket { font-size: 11px; }
code { font-size: 12.5px; }
"""


def _e(value: object) -> str:
    return html.escape(str(value))


def _facts(pairs: Iterable[tuple[str, object]]) -> str:
    rows = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in pairs)
    return f'<dl class="facts">{rows}</dl>'


def _candidates_table(decision: Decision) -> str:
    rows = []
    for c in decision.candidates:
        cls = ' class="winner"' if c.backend == decision.winner else ""
        mark = " ★" if c.backend == decision.winner else ""
        reason = f'<span class="reason">{_e(c.reason)}</span>' if c.reason else ""
        score = "-" if c.score is None else f"{c.score:.3f}"
        first, plan = first_call_s(c), plan_us(c)
        median = format_us(candidate_median_us(c)) + ("" if plan is None else f" (plan {format_us(plan)})")
        rows.append(f"<tr><td{cls}>{_e(c.backend)}{mark}</td><td>{_e(c.status)}</td>"
                    f'<td class="num">{_e(median)}</td><td class="num">{score}</td>'
                    f'<td class="num">{"-" if first is None else f"{first:.2f} s"}</td><td>{reason}</td></tr>')
    return ("<table><tr><th>backend</th><th>status</th><th>median*</th><th>score†</th>"
            "<th>first call (with compile)</th><th>reason</th></tr>" + "".join(rows) + "</table>")


def _per_shape_table(decision: Decision, buckets: list[Decision]) -> str:
    timed = [c for c in decision.candidates if any(s.timing for s in c.shapes)]
    if not timed:
        return ""
    winners = runs_at(decision, buckets)
    fastest = fastest_at(decision)
    head = "".join(f"<th>{_e(c.backend)}</th>" for c in timed)
    rows = []
    shapes = [s.shape for s in timed[0].shapes]
    for i in shape_order(shapes):
        shape = shapes[i]
        winner = winners.get(json.dumps(shape, sort_keys=True), "-")
        cells = []
        for c in timed:
            timing = c.shapes[i].timing if i < len(c.shapes) else None
            cls = "num winner" if fastest.get(i) == c.backend else "num"
            mark = ' <span class="chosen" title="get_kernel runs it at this shape">✓</span>' if c.backend == winner else ""
            cells.append(f'<td class="{cls}">{_e(format_us(timing.median_us if timing else None))}{mark}</td>')
        rows.append(f"<tr><td><code>{_e(shape_text(shape))}</code></td><td>{_e(winner)}</td>{''.join(cells)}</tr>")
    note = ('<p class="muted">Bold: the fastest median at that shape. ✓ and "runs here": the backend get_kernel runs '
            "at that shape, its bucket's winner (or the op-level winner), which is kept unless another beat it by "
            "more than the noise in every round"
            + ("; a dropped candidate's first-round times are shown but it cannot win" if any(
                c.status == "dropped" for c in timed) else "") + ".</p>")
    return (f"<table><tr><th>shape</th><th>runs here</th>{head}</tr>" + "".join(rows) + "</table>" + note)


def _runner_up_words(d: Decision) -> str:
    lead = d.lead_over_runner_up
    if lead is None or lead >= 0:
        return f"margin {format_lead(d)}: that much slower than the winner"
    return (f"{-lead:.1%} faster than {d.winner} overall, but not by more than the noise in every round, "
            f"so the default, {d.winner}, was kept")


def _badge(entry: Entry, *, titled: bool = False) -> str:
    """The status as a badge; titled: with the status's detail as its tooltip (where there is no room for it)."""
    title = f' title="{_e(entry.detail)}"' if titled and entry.detail else ""
    return f'<span class="badge {entry.status.replace(" ", "-")}"{title}>{_e(entry.status)}</span>'


def _bucket_table(rows: Sequence[Entry], op_winner: str | None) -> str:
    """One line per bucket row: its winner, runner-up and margin, its shapes, whether it runs another backend
    than the op-level winner (op_winner; None when there is no op-level row to compare with), status and layer."""
    head = "<th>vs op-level</th>" if op_winner is not None else ""
    lines = []
    for e in rows:
        d = e.decision
        other = op_winner is not None and d.winner != op_winner
        runner_up = f"{_e(d.runner_up)} ({_e(format_lead(d))})" if d.runner_up else "-"
        shapes = bucket_shapes(d)
        listed = "<br>".join(f"<code>{_e(shape_text(shapes[i]))}</code>" for i in shape_order(shapes)) or "-"
        vs = "" if op_winner is None else ('<td class="winner">another winner</td>' if other else "<td>same</td>")
        cls = ' class="winner"' if other else ""
        lines.append(f"<tr><td><code>{_e(d.bucket)}</code></td><td{cls}>"
                     f"{_e(d.winner)}</td><td>{runner_up}</td><td>{listed}</td>{vs}"
                     f'<td>{_badge(e, titled=True)} <span class="muted">{_e(e.layer_kind)} '
                     f"{_e(e.layer_path)}</span></td></tr>")
    return ("<table><tr><th>bucket</th><th>winner</th><th>runner-up (margin)</th><th>shapes</th>"
            f"{head}<th>status, layer</th></tr>" + "".join(lines) + "</table>")


def _buckets_part(section: Section) -> str:
    if not section.buckets:
        return ""
    d = section.entry.decision
    n = len(section.buckets)
    summary = (f"{section.differ} of {n} buckets run another backend than {_e(d.winner)}" if section.differ
               else f"all {n} buckets run {_e(d.winner)}")
    return (f"<h3>Per-bucket winners</h3>"
            f'<p class="muted">get_kernel sends each call to its shape bucket\'s winner ({summary}); a bucket '
            "that was not tuned takes the nearest tuned bucket's within a factor of two, else the op-level winner. "
            "Each bucket was judged on its own shapes, the op-level winner being its default.</p>"
            + _bucket_table(section.buckets, d.winner))


def _op_section(section: Section) -> str:
    entry = section.entry
    if entry is None:
        return _orphan_section(section)
    d = entry.decision
    detail = f' <span class="muted">{_e(entry.detail)}</span>' if entry.detail else ""
    winner_median = format_us(candidate_median_us(d.candidate(d.winner)))
    facts = _facts([
        ("winner", f"{d.winner} ({winner_median} median*)"),
        ("runner-up", f"{d.runner_up} ({_runner_up_words(d)})" if d.runner_up
         else "none measured to the end (the others were rejected or dropped)"),
        ("noise margin", f"{d.margin:.1%}: to rule a candidate out, the fastest had to beat it by more, "
                         "round after round (twice the typical standard error of the medians, never below "
                         f"{rule_for(d.method).floor:.0%} for {d.method or 'this timer'})"),
        ("from", f"{entry.layer_kind} layer {entry.layer_path}"),
        ("timed with", f"{d.method or '-'} in {d.tune_s:.1f} s, {d.created_at or '-'} by autosel "
                       f"{d.autosel_version or '-'}"),
        ("platform key", d.platform_key),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted(d.versions.items())) or "-"),
    ])
    chart = svg_chart(d, buckets=[b.decision for b in section.buckets])
    return (f'<section class="op"><h2>{_e(d.op)} <span class="muted">({_e(d.mode)} mode)</span> '
            f"{_badge(entry)}{detail}</h2>{facts}"
            f"<h3>Time per backend across the shapes</h3>{chart}"
            f"{_buckets_part(section)}"
            f"<h3>Candidates</h3>{_candidates_table(d)}"
            f"<h3>Per-shape winners</h3>{_per_shape_table(d, [b.decision for b in section.buckets])}</section>")


def _orphan_section(section: Section) -> str:
    """Bucket rows whose op-level row is not among the rows shown: listed, with why they decide nothing alone."""
    first = section.first
    d = first.decision
    facts = _facts([
        ("from", f"{first.layer_kind} layer {first.layer_path}"),
        ("platform key", d.platform_key),
        ("versions", ", ".join(f"{k} {v}" for k, v in sorted(d.versions.items())) or "-"),
    ])
    return (f'<section class="op"><h2>{_e(d.op)} <span class="muted">({_e(d.mode)} mode)</span> '
            f'bucket rows only {_badge(first)}</h2>{facts}'
            f'<p class="muted">No op-level row of this tune (same platform, versions and layer) is among the rows '
            "shown, so there is no overall plot. get_kernel reads a tune's bucket rows beside its op-level row "
            "only, so these decide nothing unless that row is in use.</p>"
            f"<h3>Per-bucket winners</h3>{_bucket_table(section.buckets, None)}</section>")


def _toc_item(section: Section) -> str:
    first = section.first
    d = first.decision
    if section.entry is None:
        what = f"bucket rows only ({len(section.buckets)}, no op-level row)"
    else:
        what = f"<b>{_e(d.winner)}</b>"
        if section.differ:
            what += f" ({section.differ} of {len(section.buckets)} buckets run another winner)"
        elif section.buckets:
            what += f' <span class="muted">(all {len(section.buckets)} buckets run it)</span>'
    return f"<li>{_e(d.op)} ({_e(d.mode)}): {what} {_badge(first)}</li>"


def render_report(entries: Sequence[Entry], *, platform_facts: Sequence[tuple[str, str]],
                  layers: Sequence[tuple[str, str]] = (), generated_at: str = "", autosel_version: str = "") -> str:
    """The whole page as one string. platform_facts and layers are (label, value) pairs shown at the top."""
    ordered = sections(entries)
    toc = "".join(_toc_item(s) for s in ordered)
    body = "".join(_op_section(s) for s in ordered) or '<p class="muted">No decisions to show.</p>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>autosel tuning report</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{CSS}</style></head>
<body><main>
<h1>autosel tuning report</h1>
<p class="muted">Generated {_e(generated_at)} by autosel {_e(autosel_version)}. * median: geometric mean over the
shapes of each shape's median time per call. † score: geometric mean over the shapes of time relative to the
fastest candidate at that shape (1.000 = fastest everywhere). Margin: how much slower the runner-up's score is.</p>
<h2>Platform</h2>{_facts(platform_facts)}
<h2>Tuning DB layers</h2>{_facts(layers) if layers else '<p class="muted">-</p>'}
<h2>Decisions</h2><ul>{toc}</ul>
{body}
</main></body></html>
"""
