"""The HTML report of tuning decisions: one self-contained page, plots drawn as inline SVG (no JS, no network)."""

from __future__ import annotations

import html
import json
import math
from typing import Iterable, Sequence

from autosel.decisions import CandidateResult, Decision
from autosel.inventory import Entry
from autosel.policy import geomean, rule_for, shape_text

# Tableau 10: distinguishable in print and for the common colour-vision deficiencies.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")


# --- numbers ----------------------------------------------------------------------------------------------

def candidate_median_us(candidate: CandidateResult | None) -> float | None:
    """Geometric mean over the shapes of the candidate's per-shape median time; None if it was never timed."""
    if candidate is None:
        return None
    medians = [s.timing.median_us for s in candidate.shapes if s.timing is not None and s.timing.median_us > 0]
    return geomean(medians) if medians else None


def first_call_s(candidate: CandidateResult | None) -> float | None:
    """The longest first call over the shapes: it includes compilation (torch.compile, Triton JIT), which the
    check absorbs before timing and which is reported here, separately from the timed medians."""
    values = [s.first_call_s for s in (candidate.shapes if candidate else ()) if s.first_call_s is not None]
    return max(values) if values else None


def format_us(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.3g} s"
    if value >= 1e3:
        return f"{value / 1e3:.3g} ms"
    return f"{value:.3g} µs"


def format_lead(decision: Decision) -> str:
    """How much slower the runner-up is than the winner; a runner-up that was faster overall is said in words:
    it did not beat the default by more than the noise round after round, so the default was kept."""
    lead = decision.lead_over_runner_up
    if lead is None:
        return "-"
    if lead >= 0:
        return f"{lead:+.1%}"
    return f"default kept: runner-up {-lead:.1%} faster, not beyond the noise in every round"


def shape_label(shape: dict) -> str:
    return "×".join(str(v) for v in shape.values())


def shape_order(shapes: Sequence[dict]) -> list[int]:
    """Indices of `shapes` from the smallest problem to the largest (product of the numeric values, then the
    values), so a plot's lines rise instead of zig-zagging in the order the shapes were declared."""
    def size(i: int) -> tuple:
        numbers = [v for v in shapes[i].values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        return (math.prod(numbers), [str(v) for v in shapes[i].values()])

    return sorted(range(len(shapes)), key=size)


def fastest_at(decision: Decision) -> dict[int, str]:
    """Shape index -> the candidate (measured to the end) with the lowest median there."""
    best: dict[int, tuple[float, str]] = {}
    for c in decision.candidates:
        if not c.ok:
            continue
        for i, s in enumerate(c.shapes):
            if s.timing is not None and s.timing.median_us > 0 and (i not in best or s.timing.median_us < best[i][0]):
                best[i] = (s.timing.median_us, c.backend)
    return {i: backend for i, (_, backend) in best.items()}


# --- the plot ---------------------------------------------------------------------------------------------

def _log_ticks(lo: float, hi: float) -> tuple[float, float, list[tuple[float, bool]]]:
    """Axis bounds in log10 and the ticks: (value, major). Minor 2x and 5x ticks when the range is narrow."""
    lo_exp, hi_exp = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    if hi_exp == lo_exp:
        hi_exp += 1
    ticks = []
    for exp in range(lo_exp, hi_exp + 1):
        ticks.append((10.0 ** exp, True))
        if hi_exp - lo_exp <= 3 and exp < hi_exp:
            ticks += [(2 * 10.0 ** exp, False), (5 * 10.0 ** exp, False)]
    return lo_exp, hi_exp, ticks


def svg_chart(decision: Decision, *, width: int = 880, height: int = 340) -> str:
    """Time per call of each timed backend across the shapes (smallest to largest), log scale; the winner drawn
    thick and starred, each shape's fastest ringed, p20-p80 as whiskers, a tooltip (<title>) on every point."""
    timed = [c for c in decision.candidates if any(s.timing for s in c.shapes)]
    if not timed:
        return '<p class="muted">No candidate was timed, so there is nothing to plot.</p>'
    shapes = [s.shape for s in timed[0].shapes]
    per_shape_winner = {shape: backend for shape, backend in decision.per_shape_winners}
    fastest = fastest_at(decision)
    position = {index: n for n, index in enumerate(shape_order(shapes))}  # shape index -> place on the x axis
    values = [v for c in timed for s in c.shapes if s.timing
              for v in (s.timing.median_us, s.timing.p20_us, s.timing.p80_us) if v > 0]
    lo_exp, hi_exp, ticks = _log_ticks(min(values), max(values))
    legend_chars = max(len(c.backend) + (9 if c.backend == decision.winner else 0) + (0 if c.ok else len(c.status) + 3)
                       for c in timed)
    left, right, top = 78, max(190, 50 + 8 * legend_chars), 16
    labels = [shape_label(shapes[i]) for i in shape_order(shapes)]
    rotate = max(len(t) for t in labels) * 7 > (width - left - right) / max(len(shapes), 1)
    bottom = 96 if rotate else 58
    plot_w, plot_h = width - left - right, height - top - bottom

    def x(i: int) -> float:  # i: a place on the x axis
        return left + (i + 0.5) * plot_w / len(shapes)

    def y(v: float) -> float:
        return top + plot_h * (1 - (math.log10(v) - lo_exp) / (hi_exp - lo_exp))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="time per backend for '
           f'{html.escape(decision.op)} ({html.escape(decision.mode)} mode), log scale">',
           f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="#fafafa" stroke="#ccc"/>']
    for value, major in ticks:
        ty = y(value)
        out.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{ty:.1f}" y2="{ty:.1f}" stroke="#ddd" '
                   f'stroke-dasharray="{"none" if major else "3,3"}"/>')
        out.append(f'<text x="{left - 6}" y="{ty + 4:.1f}" text-anchor="end" class="tick">'
                   f'{html.escape(format_us(value))}</text>')
    for i, label in enumerate(labels):
        if rotate:
            out.append(f'<text transform="translate({x(i):.1f},{top + plot_h + 12}) rotate(-35)" '
                       f'text-anchor="end" class="tick">{html.escape(label)}</text>')
        else:
            out.append(f'<text x="{x(i):.1f}" y="{top + plot_h + 18}" text-anchor="middle" class="tick">'
                       f'{html.escape(label)}</text>')
    keys = " × ".join(shapes[0].keys()) if shapes else "shape"
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 8}" text-anchor="middle" class="axis">'
               f'shape ({html.escape(keys)})</text>')
    out.append(f'<text transform="translate(16,{top + plot_h / 2:.1f}) rotate(-90)" text-anchor="middle" '
               'class="axis">time per call (log scale)</text>')
    order = {c.backend: n for n, c in enumerate(decision.candidates)}
    for candidate in sorted(timed, key=lambda c: c.backend == decision.winner):  # the winner on top
        color = PALETTE[order[candidate.backend] % len(PALETTE)]
        is_winner = candidate.backend == decision.winner
        points = sorted(((i, s.timing) for i, s in enumerate(candidate.shapes) if s.timing and s.timing.median_us > 0),
                        key=lambda point: position[point[0]])
        dash = "" if candidate.ok else ' stroke-dasharray="6,4"'
        path = " ".join(f"{x(position[i]):.1f},{y(t.median_us):.1f}" for i, t in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" '
                   f'stroke-width="{3.5 if is_winner else 1.6}"{dash}/>')
        for i, t in points:
            cx, cy = x(position[i]), y(t.median_us)
            if t.p20_us > 0 and t.p80_us > 0:
                out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(t.p80_us):.1f}" y2="{y(t.p20_us):.1f}" '
                           f'stroke="{color}" stroke-width="1"/>')
            shape_winner = per_shape_winner.get(json.dumps(shapes[i], sort_keys=True)) == candidate.backend
            is_fastest = fastest.get(i) == candidate.backend
            ring = ' stroke="#111" stroke-width="2"' if is_fastest else ""
            tip = (f"{candidate.backend} at {shape_text(shapes[i])}: median {format_us(t.median_us)} "
                   f"(p20 {format_us(t.p20_us)}, p80 {format_us(t.p80_us)}, {t.samples} samples)"
                   + (f"; host {format_us(t.host_us)}, device {format_us(t.device_us)} per call"
                      if t.host_us and t.device_us else "")
                   + ("; fastest at this shape" if is_fastest else "")
                   + ("; chosen at this shape" if shape_winner else ""))
            out.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{6 if is_fastest else 3.5}" fill="{color}"{ring}>'
                       f'<title>{html.escape(tip)}</title></circle>')
    legend_x, legend_y = left + plot_w + 16, top + 8
    for n, candidate in enumerate(timed):
        color = PALETTE[order[candidate.backend] % len(PALETTE)]
        ly = legend_y + n * 22
        name = candidate.backend + (" ★ winner" if candidate.backend == decision.winner else "")
        name += "" if candidate.ok else f" ({candidate.status})"
        weight = ' font-weight="bold"' if candidate.backend == decision.winner else ""
        dash = "" if candidate.ok else ' stroke-dasharray="6,4"'
        out.append(f'<line x1="{legend_x}" x2="{legend_x + 22}" y1="{ly}" y2="{ly}" stroke="{color}" '
                   f'stroke-width="{3.5 if candidate.backend == decision.winner else 1.6}"{dash}/>')
        out.append(f'<text x="{legend_x + 28}" y="{ly + 4}" class="legend"{weight}>{html.escape(name)}</text>')
    note_y = legend_y + len(timed) * 22 + 10
    out.append(f'<circle cx="{legend_x + 11}" cy="{note_y}" r="6" fill="#fff" stroke="#111" stroke-width="2"/>')
    out.append(f'<text x="{legend_x + 28}" y="{note_y + 4}" class="legend">fastest at that shape</text>')
    out.append("</svg>")
    return "\n".join(out)


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
svg text.legend { font-size: 12px; fill: #222; }
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
        first = first_call_s(c)
        rows.append(f"<tr><td{cls}>{_e(c.backend)}{mark}</td><td>{_e(c.status)}</td>"
                    f'<td class="num">{_e(format_us(candidate_median_us(c)))}</td><td class="num">{score}</td>'
                    f'<td class="num">{"-" if first is None else f"{first:.2f} s"}</td><td>{reason}</td></tr>')
    return ("<table><tr><th>backend</th><th>status</th><th>median*</th><th>score†</th>"
            "<th>first call (with compile)</th><th>reason</th></tr>" + "".join(rows) + "</table>")


def _per_shape_table(decision: Decision) -> str:
    timed = [c for c in decision.candidates if any(s.timing for s in c.shapes)]
    if not timed:
        return ""
    winners = dict(decision.per_shape_winners)
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
            mark = ' <span class="chosen" title="chosen at this shape">✓</span>' if c.backend == winner else ""
            cells.append(f'<td class="{cls}">{_e(format_us(timing.median_us if timing else None))}{mark}</td>')
        rows.append(f"<tr><td><code>{_e(shape_text(shape))}</code></td><td>{_e(winner)}</td>{''.join(cells)}</tr>")
    note = ('<p class="muted">Bold: the fastest median at that shape. ✓ and "chosen here": the backend the rule '
            "picked at that shape, which keeps the first-registered one unless another beat it by more than the "
            "noise in every round"
            + ("; a dropped candidate's first-round times are shown but it cannot win" if any(
                c.status == "dropped" for c in timed) else "") + ".</p>")
    return (f"<table><tr><th>shape</th><th>chosen here</th>{head}</tr>" + "".join(rows) + "</table>" + note)


def _runner_up_words(d: Decision) -> str:
    lead = d.lead_over_runner_up
    if lead is None or lead >= 0:
        return f"margin {format_lead(d)}: that much slower than the winner"
    return (f"{-lead:.1%} faster than {d.winner} overall, but not by more than the noise in every round, "
            f"so the default, {d.winner}, was kept")


def _op_section(entry: Entry) -> str:
    d = entry.decision
    badge = entry.status.replace(" ", "-")
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
    return (f'<section class="op"><h2>{_e(d.op)} <span class="muted">({_e(d.mode)} mode)</span> '
            f'<span class="badge {badge}">{_e(entry.status)}</span>{detail}</h2>{facts}'
            f"<h3>Time per backend across the shapes</h3>{svg_chart(d)}"
            f"<h3>Candidates</h3>{_candidates_table(d)}"
            f"<h3>Per-shape winners</h3>{_per_shape_table(d)}</section>")


def render_report(entries: Sequence[Entry], *, platform_facts: Sequence[tuple[str, str]],
                  layers: Sequence[tuple[str, str]] = (), generated_at: str = "", autosel_version: str = "") -> str:
    """The whole page as one string. platform_facts and layers are (label, value) pairs shown at the top."""
    ordered = sorted(entries, key=lambda e: (e.decision.op, e.decision.mode, e.status != "in use"))
    toc = "".join(f"<li>{_e(e.decision.op)} ({_e(e.decision.mode)}): <b>{_e(e.decision.winner)}</b> "
                  f'<span class="badge {e.status.replace(" ", "-")}">{_e(e.status)}</span></li>' for e in ordered)
    body = "".join(_op_section(e) for e in ordered) or '<p class="muted">No decisions to show.</p>'
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
