"""The plot of one decision for the HTML report (each backend's time per call across the shapes, as inline SVG),
and the ordering of its shapes (times and shapes read in words: autosel.formatting)."""

from __future__ import annotations

import html
import json
import math
from typing import Sequence

from autosel.decisions import Decision
from autosel.formatting import format_us, shape_label, shape_text

# Tableau 10: distinguishable in print and for the common colour-vision deficiencies.
PALETTE = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
           "#9c755f", "#bab0ac")


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


def bucket_shapes(decision: Decision) -> list[dict]:
    """The shapes a row's evidence covers (a bucket row: that bucket's representative shapes), in stored order."""
    seen: dict[str, dict] = {}
    for c in decision.candidates:
        for s in c.shapes:
            seen.setdefault(json.dumps(s.shape, sort_keys=True), s.shape)
    return list(seen.values())



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


def runs_at(decision: Decision, buckets: Sequence[Decision]) -> dict[str, str]:
    """Shape (as sorted JSON) -> the backend get_kernel runs there: the winner of the bucket row listing the shape,
    else the op-level winner. Not the per-shape verdict stored in per_shape_winners, whose default is the first
    registered backend where a bucket's is the op-level winner: on the shipped H200 DB the two differed at 23
    shapes."""
    runs = {json.dumps(s, sort_keys=True): decision.winner for s in bucket_shapes(decision)}
    for row in buckets:
        runs.update({json.dumps(s, sort_keys=True): row.winner for s in bucket_shapes(row)})
    return runs


def bucket_runs(shapes: Sequence[dict], buckets: Sequence[Decision]) -> list[tuple[int, int, Decision | None]]:
    """The x axis (shapes from the smallest, shape_order) cut where the bucket changes: (first place, place after
    the last, the bucket row listing those shapes or None). A shape's bucket is the row whose candidates list it.
    Empty when no shape is in any bucket row (an op without a bucket function): the chart then has no marks."""
    row_of: dict[str, Decision] = {}
    for row in buckets:
        for shape in bucket_shapes(row):
            row_of.setdefault(json.dumps(shape, sort_keys=True), row)
    places = [row_of.get(json.dumps(shapes[i], sort_keys=True)) for i in shape_order(shapes)]
    if all(row is None for row in places):
        return []
    runs: list[tuple[int, int, Decision | None]] = []
    for n, row in enumerate(places):
        if runs and runs[-1][2] is row:
            runs[-1] = (runs[-1][0], n + 1, row)
        else:
            runs.append((n, n + 1, row))
    return runs


def svg_chart(decision: Decision, *, buckets: Sequence[Decision] = (), width: int = 880, height: int = 340) -> str:
    """Time per call of each timed backend across the shapes (smallest to largest), log scale; the winner drawn
    thick and starred, each shape's fastest ringed, p20-p80 as whiskers, a tooltip (<title>) on every point.
    With the op's bucket rows, a dashed line where the bucket changes along the x axis and each stretch labelled
    with its bucket's winner along the top ("→ triton"), so a reader sees where the dispatcher switches."""
    timed = [c for c in decision.candidates if any(s.timing for s in c.shapes)]
    if not timed:
        return '<p class="muted">No candidate was timed, so there is nothing to plot.</p>'
    shapes = [s.shape for s in timed[0].shapes]
    runs_here = runs_at(decision, buckets)
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
    plot_w = width - left - right
    slot = plot_w / max(len(shapes), 1)
    runs = bucket_runs(shapes, buckets)
    # One label per stretch of adjacent buckets with the same winner: twelve one-shape buckets labelled one by one
    # overlap, and the reader wants where the dispatcher switches. (first place, place after, winner, buckets)
    stretches: list[tuple[int, int, str, list[str]]] = []
    for start, end, row in runs:
        if row is not None and stretches and stretches[-1][1] == start and stretches[-1][2] == row.winner:
            stretches[-1] = (stretches[-1][0], end, row.winner, stretches[-1][3] + [row.bucket])
        elif row is not None:
            stretches.append((start, end, row.winner, [row.bucket]))
    # One line of labels above the plot, or two alternating ones when a label is wider than its stretch.
    fits = all((len(winner) + 2) * 6.5 <= (end - start) * slot for start, end, winner, _ in stretches)
    label_rows = 0 if not runs else 1 if fits else 2
    top += 14 * label_rows
    plot_h = height - top - bottom

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
    order = {c.backend: n for n, c in enumerate(decision.candidates)}
    for (_, _, before), (start, _, row) in zip(runs, runs[1:]):
        switch = before is None or row is None or before.winner != row.winner
        look = 'class="bucket-sep switch" stroke="#666" stroke-dasharray="4,3"' if switch else \
            'class="bucket-sep" stroke="#bbb" stroke-dasharray="2,3"'
        out.append(f'<line {look} x1="{left + start * slot:.1f}" x2="{left + start * slot:.1f}" '
                   f'y1="{top - 14 * label_rows}" y2="{top + plot_h}"/>')
    for n, (start, end, winner, texts) in enumerate(stretches):
        color = PALETTE[order[winner] % len(PALETTE)] if winner in order else "#222"
        weight = ' font-weight="bold"' if winner != decision.winner else ""
        tip = (f"bucket{'s' if len(texts) > 1 else ''} {', '.join(texts)}: calls there run {winner}"
               + (f" (op-level winner {decision.winner})" if winner != decision.winner else " (the op-level winner)"))
        lx, ly = left + (start + end) / 2 * slot, top - 4 - 14 * (n % label_rows)
        out.append(f'<text class="bucket" x="{lx:.1f}" y="{ly}" text-anchor="middle" fill="{color}"{weight}>'
                   f"→ {html.escape(winner)}"
                   f"<title>{html.escape(tip)}</title></text>")
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
            shape_winner = runs_here.get(json.dumps(shapes[i], sort_keys=True)) == candidate.backend
            is_fastest = fastest.get(i) == candidate.backend
            ring = ' stroke="#111" stroke-width="2"' if is_fastest else ""
            tip = (f"{candidate.backend} at {shape_text(shapes[i])}: median {format_us(t.median_us)} "
                   f"(p20 {format_us(t.p20_us)}, p80 {format_us(t.p80_us)}, {t.samples} samples)"
                   + (f"; host {format_us(t.host_us)}, device {format_us(t.device_us)} per call"
                      if t.host_us and t.device_us else "")
                   + ("; fastest at this shape" if is_fastest else "")
                   + ("; get_kernel runs it at this shape" if shape_winner else ""))
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
    if runs:
        out.append(f'<line x1="{legend_x + 11}" x2="{legend_x + 11}" y1="{note_y + 14}" y2="{note_y + 46}" '
                   'stroke="#666" stroke-dasharray="4,3"/>')
        out.append(f'<text x="{legend_x + 28}" y="{note_y + 26}" class="legend">bucket boundary</text>')
        out.append(f'<text x="{legend_x + 28}" y="{note_y + 42}" class="legend">→ the winner there</text>')
    out.append("</svg>")
    return "\n".join(out)
