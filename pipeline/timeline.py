"""``hispec trace FILE``: draw every request of a JSON-lines log as a timeline, and export it.

One row per request, one coloured band per stretch of time in one state (from the lifecycle events
written by ``Request.apply``), a marker where it ended, and a triangle on its band where it was
demoted (down) or promoted (up) under dynamic residency. Written as a self-contained HTML page
(inline SVG, a tooltip on every band and marker, a zoomable time axis, per-state duration
percentiles, a table of requests) and, where matplotlib is installed, a PNG (Agg backend). Idle
stretches (no request live) longer than ``--idle-gap`` are drawn narrow, so a long server log stays
readable; ``--request``, ``--state`` and ``--mark`` keep some requests only. ``--perfetto FILE``
writes the same lifecycles (and the executor's commands) as Chrome/Perfetto trace-event JSON,
``--otlp-traces-endpoint URL`` sends each request as an OpenTelemetry span with one child span per
state (the ``otel`` extra); the marks become instant events and span events.
"""

from __future__ import annotations

import argparse
import bisect
import html
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from pipeline.logs import read_json_lines
from pipeline.stretches import LIVE_STATES, MARK_KINDS, TERMINAL_STATES, Mark, Row, build_rows, select

# state -> colour (terminal states colour the end marker)
COLOURS = {
    "queued": "#b0b0b0",
    "prefill": "#f28e2b",
    "staging": "#edc948",
    "ready": "#8cd17d",
    "decode": "#4e79a7",
    "draft": "#b07aa1",
    "verify": "#76b7b2",
    "finished": "#2ca02c",
    "aborted": "#d62728",
    "failed": "#000000",
}
# mark kind -> (colour, SVG glyph, matplotlib marker): a demotion points down, a promotion up
MARK_STYLES = {"demoted": ("#e15759", "\u25bc", "v"), "promoted": ("#59a14f", "\u25b2", "^")}
IDLE_GAP_S = 1.0  # default: idle stretches longer than this are drawn narrow
IDLE_SHARE = 0.015  # the width of a narrowed idle stretch, as a share of the busy time drawn
PERCENTILES = (50, 90, 99)
WHOLE = "request"  # the percentile table's line for whole requests (arrival or first event to the end)


# --- per-state durations ------------------------------------------------------------------------------


@attrs.frozen
class StateDurations:
    """How long the stretches in one state lasted (seconds), over the requests drawn."""

    state: str
    stretches: int
    requests: int
    percentiles: tuple[float, ...]  # at PERCENTILES
    max: float
    total: float


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the closest ranks."""
    if not sorted_values:
        raise ValueError("no values")
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def state_durations(rows: Sequence[Row]) -> list[StateDurations]:
    """One line per live state seen (in lifecycle order), then one for whole requests (those that
    ended: from arrival, or their first event, to the end)."""
    found: dict[str, list[float]] = {}
    requests: dict[str, set[str]] = {}
    for row in rows:
        for b in row.bands:
            found.setdefault(b.state, []).append(b.end - b.start)
            requests.setdefault(b.state, set()).add(row.request_id)
        if row.end is not None and row.start is not None:
            found.setdefault(WHOLE, []).append(row.end - row.start)
            requests.setdefault(WHOLE, set()).add(row.request_id)
    out = []
    for state in (*LIVE_STATES, WHOLE):
        values = sorted(found.get(state, ()))
        if values:
            out.append(
                StateDurations(
                    state,
                    len(values),
                    len(requests[state]),
                    tuple(percentile(values, q) for q in PERCENTILES),
                    values[-1],
                    sum(values),
                )
            )
    return out


def marks_summary(rows: Sequence[Row]) -> str:
    """One line per kind of mark the rows have: how many, of how many requests, the bytes moved
    ("" when none has a mark)."""
    lines = []
    for kind in MARK_KINDS:
        marks = [(row.request_id, m) for row in rows for m in row.marks if m.kind == kind]
        if marks:
            moved = "freed on the device" if kind == "demoted" else "copied host -> device"
            requests = len({rid for rid, _ in marks})
            lines.append(
                f"{kind}: {_count(len(marks), 'time')}, {_count(requests, 'request')}, "
                f"{sum(m.num_bytes for _, m in marks)} bytes {moved}"
            )
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _mark_tip(label: str, mark: Mark, t0: float) -> str:
    moved = f"{mark.bytes_field} {mark.num_bytes}"
    return f"{label}: {mark.kind} in {mark.state} at {mark.at - t0:.4f}s ({moved})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}" if seconds < 10 else f"{seconds * 1e3:.0f}"


def durations_table(stats: Sequence[StateDurations]) -> str:
    """The per-state durations as aligned text (milliseconds)."""
    head = ["state", "stretches", "requests", *(f"p{q} ms" for q in PERCENTILES), "max ms", "total s"]
    lines = [head] + [
        [s.state, str(s.stretches), str(s.requests), *(_ms(p) for p in s.percentiles), _ms(s.max),
         f"{s.total:.3f}"]
        for s in stats
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    )


# --- the time axis: idle stretches drawn narrow --------------------------------------------------------


@attrs.frozen
class Segment:
    """A piece of the time axis: real seconds [start, end) drawn over [at, at + width) seconds of the
    axis; an idle segment (no request live) is drawn narrower than it lasted."""

    start: float
    end: float
    at: float
    width: float
    idle: bool


@attrs.frozen
class TimeAxis:
    t0: float  # the first time drawn (seconds since the epoch)
    segments: tuple[Segment, ...]
    ends: tuple[float, ...] = attrs.field(init=False)  # each segment's end (the next one starts there)

    @ends.default
    def _ends(self) -> tuple[float, ...]:
        return tuple(seg.end for seg in self.segments)

    @property
    def span(self) -> float:
        """The axis' length in drawn seconds."""
        last = self.segments[-1]
        return max(last.at + last.width, 1e-6)

    @property
    def idle(self) -> list[Segment]:
        return [s for s in self.segments if s.idle]

    def __call__(self, t: float) -> float:
        """Real time (since the epoch) -> position on the axis (drawn seconds from its start)."""
        s = self.segments[min(bisect.bisect_right(self.ends, t), len(self.segments) - 1)]
        if t <= s.start:
            return s.at
        if s.end <= s.start:
            return s.at + s.width
        return s.at + min(t - s.start, s.end - s.start) / (s.end - s.start) * s.width

    def real(self, x: float) -> float | None:
        """Position on the axis -> seconds since ``t0`` (None inside a narrowed idle segment)."""
        for s in self.segments:
            if not s.idle and s.at - 1e-9 <= x <= s.at + s.width + 1e-9:
                return s.start - self.t0 + (x - s.at)
        return None

    def ticks(self, lo: float, hi: float, count: int = 8) -> list[tuple[float, str]]:
        """(position, label) at round steps of the axis between ``lo`` and ``hi``, none in idle
        segments; labels in seconds since ``t0``."""
        return [(x, _seconds_label(real, step)) for x, real, step in _tick_positions(self, lo, hi, count)]

    def as_json(self) -> list[list[float | bool]]:
        return [[s.start - self.t0, s.end - self.t0, s.at, s.width, s.idle] for s in self.segments]


def _nice_step(raw: float) -> float:
    exponent = math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * 10**exponent >= raw:
            return m * 10**exponent
    return 10 ** (exponent + 1)


def _tick_positions(axis: TimeAxis, lo: float, hi: float, count: int) -> list[tuple[float, float, float]]:
    """Ticks at round real times in every busy segment that shows between ``lo`` and ``hi``."""
    shown = [s for s in axis.segments if not s.idle and s.at + s.width >= lo and s.at <= hi]
    visible = sum(min(s.at + s.width, hi) - max(s.at, lo) for s in shown)
    if visible <= 0:
        return []
    step = _nice_step(max(visible / count, 1e-6))
    out = []
    for s in shown:
        a, b = max(s.at, lo), min(s.at + s.width, hi)
        real_a = s.start - axis.t0 + (a - s.at)
        first = math.ceil(real_a / step - 1e-9) * step
        t = first
        while t - (s.start - axis.t0) + s.at <= b + 1e-12:
            out.append((t - (s.start - axis.t0) + s.at, t, step))
            t += step
    apart = (hi - lo) / (count * 2.5)  # a tick nearer to the one before (across an idle stretch): left out
    kept: list[tuple[float, float, float]] = []
    for tick in out:
        if not kept or tick[0] - kept[-1][0] >= apart:
            kept.append(tick)
    return kept


def _seconds_label(t: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step))) if step < 1 else 0
    return f"{t:.{decimals}f}s"


def time_axis(rows: Sequence[Row], idle_gap: float | None = IDLE_GAP_S) -> TimeAxis:
    """The axis of ``rows``: real time, except that every stretch longer than ``idle_gap`` seconds in
    which no request drawn is live is narrowed (``None``: never)."""
    busy = sorted((r.start, r.last) for r in rows if r.start is not None and r.last is not None)
    merged: list[list[float]] = []
    for start, end in busy:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    if not merged:
        return TimeAxis(0.0, (Segment(0.0, 1e-6, 0.0, 1e-6, False),))
    busy_total = sum(b - a for a, b in merged)
    narrow = IDLE_SHARE * busy_total if busy_total > 0 else (idle_gap or 1.0)
    segments: list[Segment] = []
    at = 0.0
    for i, (start, end) in enumerate(merged):
        if i:
            gap_start = merged[i - 1][1]
            gap = start - gap_start
            idle = idle_gap is not None and gap > idle_gap and gap > narrow
            width = min(gap, narrow) if idle else gap
            segments.append(Segment(gap_start, start, at, width, idle))
            at += width
        segments.append(Segment(start, end, at, end - start, False))
        at += end - start
    return TimeAxis(merged[0][0], tuple(segments))


# --- PNG -------------------------------------------------------------------------------------------------


def write_png(rows: list[Row], path: Path, title: str, axis: TimeAxis | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    axis = axis or time_axis(rows, None)
    height = max(2.6, 0.34 * len(rows) + 1.6)
    fig, ax = plt.subplots(figsize=(11, height), dpi=110)
    for seg in axis.idle:
        ax.axvspan(seg.at, seg.at + seg.width, facecolor="#f4f4f4", edgecolor="#c0c0c0", hatch="//",
                   linewidth=0)
        ax.annotate(
            f"idle {seg.end - seg.start:.1f}s", (seg.at + seg.width / 2, 1),
            xycoords=("data", "axes fraction"),
            xytext=(0, 2), textcoords="offset points", fontsize=7, ha="center", va="bottom", color="#777777",
        )
    for y, row in enumerate(rows):
        for state in LIVE_STATES:
            spans = [(axis(b.start), axis(b.end) - axis(b.start)) for b in row.bands if b.state == state]
            if spans:
                ax.broken_barh(spans, (y - 0.38, 0.76), facecolors=COLOURS[state], linewidth=0)
        for kind, (colour, _, marker) in MARK_STYLES.items():
            at = [axis(m.at) for m in row.marks if m.kind == kind]
            if at:
                ax.plot(at, [y] * len(at), linestyle="none", marker=marker, markersize=6, color=colour,
                        markeredgecolor="white", markeredgewidth=0.5)
        if row.end is not None:
            x = axis(row.end)
            ax.plot([x], [y], marker="D", markersize=5, color=COLOURS.get(row.final, "black"))
            ax.annotate(row.reason, (x, y), xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.set_yticks(range(len(rows)), [r.request_id for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ticks = axis.ticks(0, axis.span)
    ax.set_xticks([x for x, _ in ticks], [label for _, label in ticks], fontsize=8)
    ax.set_xlim(0, axis.span * 1.08)
    narrowed = " (hatched: idle time, drawn narrow)" if axis.idle else ""
    ax.set_xlabel(f"seconds since the first event{narrowed}")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=10, pad=14 if axis.idle else 6)
    legend: list[Any] = [Patch(color=COLOURS[s], label=s) for s in LIVE_STATES]
    legend += [Patch(color=COLOURS[s], label=f"{s} (end)") for s in TERMINAL_STATES]
    legend += [
        Line2D([], [], linestyle="none", marker=marker, color=colour, label=kind)
        for kind, (colour, _, marker) in MARK_STYLES.items()
        if any(row.count(kind) for row in rows)
    ]
    fig.legend(handles=legend, ncol=len(legend), fontsize=7, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1))
    fig.savefig(path)
    plt.close(fig)


# --- HTML ------------------------------------------------------------------------------------------------

LEFT, RIGHT, TOP, ROW_H = 150, 70, 24, 20


def svg(rows: list[Row], width: int = 1100, axis: TimeAxis | None = None) -> str:
    """The timeline as an inline SVG element (a <title> tooltip on every band). Every drawn element
    of the plot carries its place on the axis (``data-a``, ``data-b``: drawn seconds), which the
    page's script reads to zoom."""
    axis = axis or time_axis(rows, None)
    t0 = axis.t0
    plot_w = width - LEFT - RIGHT
    x = lambda t: LEFT + axis(t) / axis.span * plot_w  # noqa: E731
    height = TOP + ROW_H * len(rows) + 30
    out = [
        f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" data-left="{LEFT}" data-plot-width="{plot_w}" data-span="{axis.span!r}">',
        f'<defs><clipPath id="plot-clip"><rect x="{LEFT}" y="0" width="{plot_w + RIGHT}" '
        f'height="{height}"/></clipPath>'
        '<pattern id="idle-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f4f4f4"/>'
        '<line x1="0" y1="0" x2="0" y2="6" stroke="#c8c8c8" stroke-width="2"/></pattern></defs>',
        '<g id="ticks">',
    ]
    for pos, label in axis.ticks(0, axis.span):
        px = LEFT + pos / axis.span * plot_w
        out.append(f'<line x1="{px:.1f}" y1="{TOP - 4}" x2="{px:.1f}" y2="{height - 24}" stroke="#e4e4e4"/>')
        out.append(f'<text x="{px:.1f}" y="{height - 10}" font-size="10" text-anchor="middle">{label}</text>')
    out.append('</g><g id="plot" clip-path="url(#plot-clip)">')
    for seg in axis.idle:
        tip = f"idle {seg.end - seg.start:.3f}s ({seg.start - t0:.3f}s - {seg.end - t0:.3f}s), drawn narrow"
        out.append(
            f'<rect class="idle" data-a="{seg.at!r}" data-b="{seg.at + seg.width!r}" '
            f'x="{LEFT + seg.at / axis.span * plot_w:.2f}" y="{TOP - 4}" '
            f'width="{max(seg.width / axis.span * plot_w, 1):.2f}" height="{height - 24 - TOP + 4}" '
            f'fill="url(#idle-hatch)"><title>{tip}</title></rect>'
        )
    for y_index, row in enumerate(rows):
        y = TOP + y_index * ROW_H
        label = html.escape(row.request_id)
        for b in row.bands:
            w = max(x(b.end) - x(b.start), 0.5)
            steps = f", {b.events} events" if b.events > 1 else ""
            tip = (
                f"{label}: {b.state} {b.start - t0:.4f}s - {b.end - t0:.4f}s "
                f"({(b.end - b.start) * 1e3:.2f} ms{steps})"
            )
            out.append(
                f'<rect data-a="{axis(b.start)!r}" data-b="{axis(b.end)!r}" x="{x(b.start):.2f}" '
                f'y="{y + 3}" width="{w:.2f}" height="{ROW_H - 6}" fill="{COLOURS[b.state]}">'
                f"<title>{tip}</title></rect>"
            )
        for mark in row.marks:
            colour, glyph, _ = MARK_STYLES[mark.kind]
            out.append(
                f'<text class="mark" data-a="{axis(mark.at)!r}" x="{x(mark.at):.2f}" y="{y + ROW_H / 2 + 4}" '
                f'font-size="11" text-anchor="middle" fill="{colour}" stroke="white" stroke-width="0.5">'
                f"{glyph}<title>{_mark_tip(label, mark, t0)}</title></text>"
            )
        if row.end is not None:
            cx = x(row.end)
            tip = f"{label}: {row.final} ({html.escape(row.reason)}) at {row.end - t0:.4f}s"
            out.append(
                f'<circle data-a="{axis(row.end)!r}" cx="{cx:.2f}" cy="{y + ROW_H / 2}" r="4" '
                f'fill="{COLOURS.get(row.final, "black")}"><title>{tip}</title></circle>'
            )
            out.append(
                f'<text data-a="{axis(row.end)!r}" data-dx="7" x="{cx + 7:.2f}" y="{y + 14}" '
                f'font-size="10">{html.escape(row.reason)}</text>'
            )
    out.append("</g>")
    for y_index, row in enumerate(rows):  # the labels stay put while the plot zooms
        y = TOP + y_index * ROW_H
        out.append(
            f'<text x="{LEFT - 6}" y="{y + 13}" font-size="11" text-anchor="end">'
            f"{html.escape(row.request_id)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out)


# The page's zoom: the wheel zooms around the pointer, a drag pans, a double click (or the button)
# shows everything again. Positions are the axis' (drawn seconds); tick labels are real seconds.
ZOOM_SCRIPT = """
(function () {
  const svg = document.getElementById("timeline");
  const left = +svg.dataset.left, plotW = +svg.dataset.plotWidth, span = +svg.dataset.span;
  const segments = JSON.parse(document.getElementById("axis-segments").textContent);
  const height = +svg.getAttribute("height"), top = 20;
  const view = document.getElementById("view");
  let lo = 0, hi = span;
  const px = (a) => left + (a - lo) / (hi - lo) * plotW;
  function niceStep(raw) {
    const e = Math.floor(Math.log10(raw));
    for (const m of [1, 2, 5, 10]) if (m * 10 ** e >= raw) return m * 10 ** e;
    return 10 ** (e + 1);
  }
  function realAt(a) {
    for (const [start, end, at, width, idle] of segments)
      if (!idle && at - 1e-9 <= a && a <= at + width + 1e-9) return start + (a - at);
    return null;
  }
  function ticks() {
    const g = document.getElementById("ticks");
    g.textContent = "";
    const shown = segments.filter(([s, e, at, w, idle]) => !idle && at + w >= lo && at <= hi);
    const visible = shown.reduce((n, [s, e, at, w]) => n + Math.min(at + w, hi) - Math.max(at, lo), 0);
    if (visible <= 0) return;
    const step = niceStep(Math.max(visible / 8, 1e-6));
    const decimals = step < 1 ? Math.max(0, -Math.floor(Math.log10(step))) : 0;
    const ns = "http://www.w3.org/2000/svg";
    const apart = (hi - lo) / 20;
    let last = -Infinity;
    for (const [start, end, at, w] of shown) {
      const a = Math.max(at, lo), b = Math.min(at + w, hi);
      for (let t = Math.ceil((start + a - at) / step - 1e-9) * step; t - start + at <= b + 1e-12; t += step) {
        if (t - start + at - last < apart) continue;
        last = t - start + at;
        const x = px(last);
        const line = document.createElementNS(ns, "line");
        line.setAttribute("x1", x); line.setAttribute("x2", x);
        line.setAttribute("y1", top); line.setAttribute("y2", height - 24);
        line.setAttribute("stroke", "#e4e4e4");
        const text = document.createElementNS(ns, "text");
        text.setAttribute("x", x); text.setAttribute("y", height - 10);
        text.setAttribute("font-size", "10"); text.setAttribute("text-anchor", "middle");
        text.textContent = t.toFixed(decimals) + "s";
        g.append(line, text);
      }
    }
  }
  function draw() {
    for (const el of svg.querySelectorAll("#plot [data-a]")) {
      const a = +el.dataset.a;
      if (el.tagName === "circle") el.setAttribute("cx", px(a));
      else if (el.tagName === "text") el.setAttribute("x", px(a) + (+el.dataset.dx || 0));
      else {
        el.setAttribute("x", px(a));
        const least = el.classList.contains("idle") ? 1 : 0.5;
        el.setAttribute("width", Math.max(px(+el.dataset.b) - px(a), least));
      }
    }
    ticks();
    const a = realAt(lo), b = realAt(hi);
    view.textContent = (lo <= 0 && hi >= span) ? "everything" :
      (a === null ? "idle" : a.toFixed(3) + "s") + " to " + (b === null ? "idle" : b.toFixed(3) + "s");
  }
  function axisAt(evt) {
    const box = svg.getBoundingClientRect();
    return lo + (evt.clientX - box.left - left) / plotW * (hi - lo);
  }
  svg.addEventListener("wheel", (evt) => {
    evt.preventDefault();
    const at = Math.min(Math.max(axisAt(evt), lo), hi), f = evt.deltaY < 0 ? 0.8 : 1.25;
    const width = Math.min(Math.max((hi - lo) * f, span * 1e-6), span);
    lo = Math.max(0, at - (at - lo) / (hi - lo) * width); hi = Math.min(span, lo + width); lo = hi - width;
    draw();
  }, {passive: false});
  let dragging = null;
  svg.addEventListener("mousedown", (evt) => { dragging = {x: evt.clientX, lo, hi}; });
  window.addEventListener("mouseup", () => { dragging = null; });
  window.addEventListener("mousemove", (evt) => {
    if (!dragging) return;
    const shift = (dragging.x - evt.clientX) / plotW * (dragging.hi - dragging.lo);
    const width = dragging.hi - dragging.lo;
    lo = Math.min(Math.max(dragging.lo + shift, 0), span - width); hi = lo + width;
    draw();
  });
  const reset = () => { lo = 0; hi = span; draw(); };
  svg.addEventListener("dblclick", reset);
  document.getElementById("reset").addEventListener("click", reset);
  draw();
})();
"""


def write_html(
    rows: list[Row],
    path: Path,
    title: str,
    axis: TimeAxis | None = None,
    stats: Sequence[StateDurations] | None = None,
    note: str = "",
) -> None:
    axis = axis or time_axis(rows, None)
    stats = state_durations(rows) if stats is None else stats
    legend = " ".join(
        f'<span style="display:inline-block;margin-right:12px"><span style="display:inline-block;width:12px;'
        f'height:12px;background:{c};vertical-align:middle"></span> {s}</span>'
        for s, c in COLOURS.items()
    )
    kinds = [kind for kind in MARK_KINDS if any(r.count(kind) for r in rows)]  # columns for those seen
    legend += "".join(
        f' <span style="margin-right:12px"><span style="color:{MARK_STYLES[k][0]}">'
        f"{MARK_STYLES[k][1]}</span> {k}</span>"
        for k in kinds
    )
    table = "".join(
        f"<tr><td>{html.escape(r.request_id)}</td><td>{r.final}</td><td>{html.escape(r.reason)}</td>"
        f"<td>{'' if r.output_tokens is None else r.output_tokens}</td>"
        f"<td>{'' if r.end is None or r.start is None else f'{r.end - r.start:.4f}'}</td>"
        + "".join(f"<td>{r.count(k)}</td>" for k in kinds)
        + "</tr>"
        for r in rows
    )
    mark_heads = "".join(f"<th>{k}</th>" for k in kinds)
    summary = "".join(f"<p>{html.escape(line)}</p>" for line in marks_summary(rows).splitlines())
    percentile_head = "".join(f"<th>p{q} ms</th>" for q in PERCENTILES)
    percentiles = "".join(
        f"<tr><td>{s.state}</td><td>{s.stretches}</td><td>{s.requests}</td>"
        + "".join(f"<td>{_ms(p)}</td>" for p in s.percentiles)
        + f"<td>{_ms(s.max)}</td><td>{s.total:.3f}</td></tr>"
        for s in stats
    )
    idle = axis.idle
    idle_note = (
        f"{len(idle)} idle stretch{'es' if len(idle) > 1 else ''} (no request live) drawn narrow, "
        f"{sum(s.end - s.start for s in idle):.3f}s in all (hatched). "
        if idle
        else ""
    )
    segments = json.dumps(axis.as_json()).replace("</", "<\\/")
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:20px}} td,th{{padding:2px 10px;text-align:left}}
table{{border-collapse:collapse}} tr:nth-child(even){{background:#f4f4f4}}
#timeline{{cursor:grab;user-select:none}} .num td+td{{text-align:right}}</style></head>
<body><h2>{html.escape(title)}</h2><p>{html.escape(note)}</p><p>{legend}</p>
<p style="font-size:90%">{idle_note}Wheel: zoom; drag: pan; double click or
<button id="reset">show everything</button>. Shown: <span id="view">everything</span>.</p>
{svg(rows, axis=axis)}
<script type="application/json" id="axis-segments">{segments}</script>
<script>{ZOOM_SCRIPT}</script>
<h3>Time in each state</h3>
<p style="font-size:90%">A stretch: time spent in one state without a break (a run of decode steps is one
stretch); <i>{WHOLE}</i>: from arrival (or the first event) to the end, requests that ended.</p>
<table class="num"><tr><th>state</th><th>stretches</th><th>requests</th>{percentile_head}<th>max ms</th>
<th>total s</th></tr>{percentiles}</table>{summary}
<h3>Requests</h3><table><tr><th>request</th><th>final state</th><th>reason</th><th>output tokens</th>
<th>seconds from arrival to end</th>{mark_heads}</tr>{table}</table></body></html>
"""
    path.write_text(page, encoding="utf-8")


# --- the command -----------------------------------------------------------------------------------------


def _idle_gap(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hispec trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a JSON-lines log (--log-json FILE of generate or serve)")
    parser.add_argument("--out-png", help="default: the log's name with .png")
    parser.add_argument("--out-html", help="default: the log's name with .html")
    parser.add_argument(
        "--request", action="append", default=[], metavar="ID",
        help="only this request (an id or a shell pattern such as 'chatcmpl-1*'; repeatable)",
    )
    parser.add_argument(
        "--state", action="append", default=[], metavar="S", choices=[*LIVE_STATES, *TERMINAL_STATES],
        help="only the requests that were in state S at some point (a terminal state: that ended in it; "
        f"repeatable): {', '.join([*LIVE_STATES, *TERMINAL_STATES])}",
    )
    parser.add_argument(
        "--mark", action="append", default=[], metavar="KIND", choices=MARK_KINDS,
        help="only the requests with a KIND mark (dynamic residency; repeatable): "
        f"{', '.join(MARK_KINDS)}",
    )
    parser.add_argument(
        "--idle-gap", type=_idle_gap, default=IDLE_GAP_S, metavar="SECONDS",
        help=f"draw narrow every stretch longer than this with no request live (default {IDLE_GAP_S:g})",
    )
    parser.add_argument("--keep-idle", action="store_true", help="draw idle time to scale too")
    parser.add_argument(
        "--perfetto", metavar="FILE",
        help="also write Chrome/Perfetto trace-event JSON (ui.perfetto.dev, chrome://tracing)",
    )
    parser.add_argument(
        "--otlp-traces-endpoint", metavar="URL",
        help="also send each request as an OpenTelemetry span (OTLP over HTTP, e.g. "
        "http://localhost:4318/v1/traces; the `otel` extra)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_path = Path(args.log)
    records = read_json_lines(log_path)
    every = build_rows(records)
    if not every:
        print(f"hispec trace: no lifecycle events in {log_path}")
        return 1
    rows = select(every, args.request, args.state, args.mark)
    if not rows:
        print(f"hispec trace: none of the {len(every)} requests in {log_path} matches the filters")
        return 1
    shown = f"{len(rows)} of {len(every)} requests" if len(rows) < len(every) else f"{len(rows)} requests"
    title = f"hispec request timeline: {shown} ({log_path.name})"
    filters = [f"--request {p}" for p in args.request] + [f"--state {s}" for s in args.state]
    filters += [f"--mark {k}" for k in args.mark]
    note = f"filters: {' '.join(filters)}" if filters else ""
    axis = time_axis(rows, None if args.keep_idle else args.idle_gap)
    stats = state_durations(rows)
    print(durations_table(stats))
    if summary := marks_summary(rows):
        print(summary)
    png = Path(args.out_png) if args.out_png else log_path.with_suffix(".png")
    page = Path(args.out_html) if args.out_html else log_path.with_suffix(".html")
    write_html(rows, page, title, axis, stats, note)  # needs nothing beyond the standard library
    written = [page]
    status = 0
    if args.perfetto:
        from pipeline.trace_export import write_perfetto

        ids = {r.request_id for r in rows}
        write_perfetto(Path(args.perfetto), rows, records, keep=None if len(rows) == len(every) else ids)
        written.append(Path(args.perfetto))
    if args.otlp_traces_endpoint:
        from pipeline.trace_export import OtelMissing, OtlpExportError, export_otlp

        try:
            sent = export_otlp(rows, args.otlp_traces_endpoint)
        except (OtelMissing, ValueError) as exc:  # not installed, or not a URL
            print(f"hispec trace: no OTLP export: {exc}", file=sys.stderr)
            status = 2
        except OtlpExportError as exc:
            print(f"hispec trace: {exc}", file=sys.stderr)
            status = 1
        else:
            print(f"sent {sent} spans of {len(rows)} requests to {args.otlp_traces_endpoint}")
    try:
        import matplotlib  # noqa: F401 -- only to know whether the PNG can be drawn
    except ImportError:
        print(f"wrote {' and '.join(map(str, written))}")
        print(
            "hispec trace: no PNG: matplotlib is not installed (pip install matplotlib, or the "
            "`bench` extra)",
            file=sys.stderr,
        )
        return 2 if args.out_png else status  # a PNG asked for by name and not written is a failure
    write_png(rows, png, title, axis)
    print(f"wrote {' and '.join(map(str, [png, *written]))}")
    return status
