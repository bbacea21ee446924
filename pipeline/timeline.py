"""``hispec trace FILE``: draw every request of a JSON-lines log as a timeline.

One row per request, one coloured band per state it was in (from the lifecycle events written by
``Request.apply``), a marker where it ended. Written twice: a self-contained HTML page (inline SVG, a
tooltip on every band, a summary table) and, where matplotlib is installed, a PNG (Agg backend).
"""

from __future__ import annotations

import argparse
import html
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from pipeline.logs import arrivals, bands, by_request, read_json_lines

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
LIVE_STATES = ("queued", "prefill", "staging", "ready", "decode", "draft", "verify")


@attrs.frozen
class Span:
    """A ``Band`` of a live state, which has an end."""

    state: str
    start: float  # seconds since the epoch
    end: float


@attrs.frozen
class Row:
    request_id: str
    bands: tuple[Span, ...]  # live states
    end: float | None  # when it reached its terminal state
    final: str  # the last state logged
    reason: str  # finish reason, or "" while live
    output_tokens: int | None


def build_rows(records: list[dict]) -> list[Row]:
    """One row per request of the log, in order of first appearance."""
    arrived = arrivals(records)
    rows = []
    for rid, events in by_request(records).items():
        spans = list(bands(events, arrived.get(rid)))
        live = tuple(Span(b.state, b.start, b.end) for b in spans if b.end is not None)
        last = events[-1]
        terminal = spans[-1] if spans and spans[-1].end is None and last["state"] not in LIVE_STATES else None
        rows.append(
            Row(
                request_id=rid,
                bands=live,
                end=terminal.start if terminal else None,
                final=last["state"],
                reason=str(last.get("reason", "")) if terminal else "",
                output_tokens=last.get("output_tokens"),
            )
        )
    return rows


def time_range(rows: list[Row]) -> tuple[float, float]:
    starts = [b.start for r in rows for b in r.bands] + [r.end for r in rows if r.end is not None]
    ends = [b.end for r in rows for b in r.bands] + [r.end for r in rows if r.end is not None]
    t0, t1 = min(starts), max(ends)
    return t0, max(t1, t0 + 1e-6)


def write_png(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    t0, t1 = time_range(rows)
    height = max(2.6, 0.34 * len(rows) + 1.6)
    fig, ax = plt.subplots(figsize=(11, height), dpi=110)
    for y, row in enumerate(rows):
        for state in LIVE_STATES:
            spans = [(b.start - t0, b.end - b.start) for b in row.bands if b.state == state]
            if spans:
                ax.broken_barh(spans, (y - 0.38, 0.76), facecolors=COLOURS[state], linewidth=0)
        if row.end is not None:
            ax.plot([row.end - t0], [y], marker="D", markersize=5, color=COLOURS.get(row.final, "black"))
            ax.annotate(row.reason, (row.end - t0, y), xytext=(6, -3), textcoords="offset points", fontsize=7)
    ax.set_yticks(range(len(rows)), [r.request_id for r in rows], fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, (t1 - t0) * 1.08)
    ax.set_xlabel("seconds since the first event")
    ax.grid(axis="x", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(title, fontsize=10)
    legend = [Patch(color=COLOURS[s], label=s) for s in LIVE_STATES]
    legend += [Patch(color=COLOURS[s], label=f"{s} (end)") for s in ("finished", "aborted", "failed")]
    fig.legend(handles=legend, ncol=len(legend), fontsize=7, loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1))
    fig.savefig(path)
    plt.close(fig)


def svg(rows: list[Row], width: int = 1100) -> str:
    """The timeline as an inline SVG element (a <title> tooltip on every band)."""
    t0, t1 = time_range(rows)
    left, right, top, row_h = 110, 70, 24, 20
    span = width - left - right
    x = lambda t: left + (t - t0) / (t1 - t0) * span  # noqa: E731
    height = top + row_h * len(rows) + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif">'
    ]
    for i in range(6):
        t = t0 + (t1 - t0) * i / 5
        out.append(
            f'<line x1="{x(t):.1f}" y1="{top - 4}" x2="{x(t):.1f}" y2="{height - 24}" stroke="#e4e4e4"/>'
        )
        out.append(
            f'<text x="{x(t):.1f}" y="{height - 10}" font-size="10" text-anchor="middle">{t - t0:.3f}s</text>'
        )
    for y_index, row in enumerate(rows):
        y = top + y_index * row_h
        label = html.escape(row.request_id)
        out.append(f'<text x="{left - 6}" y="{y + 13}" font-size="11" text-anchor="end">{label}</text>')
        for b in row.bands:
            w = max(x(b.end) - x(b.start), 0.5)
            tip = (
                f"{label}: {b.state} {b.start - t0:.4f}s - {b.end - t0:.4f}s "
                f"({(b.end - b.start) * 1e3:.2f} ms)"
            )
            out.append(
                f'<rect x="{x(b.start):.2f}" y="{y + 3}" width="{w:.2f}" height="{row_h - 6}" '
                f'fill="{COLOURS[b.state]}"><title>{tip}</title></rect>'
            )
        if row.end is not None:
            cx = x(row.end)
            tip = f"{label}: {row.final} ({html.escape(row.reason)}) at {row.end - t0:.4f}s"
            out.append(
                f'<circle cx="{cx:.2f}" cy="{y + row_h / 2}" r="4" fill="{COLOURS.get(row.final, "black")}">'
                f"<title>{tip}</title></circle>"
            )
            out.append(f'<text x="{cx + 7:.2f}" y="{y + 14}" font-size="10">{html.escape(row.reason)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_html(rows: list[Row], path: Path, title: str) -> None:
    legend = " ".join(
        f'<span style="display:inline-block;margin-right:12px"><span style="display:inline-block;width:12px;'
        f'height:12px;background:{c};vertical-align:middle"></span> {s}</span>'
        for s, c in COLOURS.items()
    )
    table = "".join(
        f"<tr><td>{html.escape(r.request_id)}</td><td>{r.final}</td><td>{html.escape(r.reason)}</td>"
        f"<td>{'' if r.output_tokens is None else r.output_tokens}</td>"
        f"<td>{'' if r.end is None or not r.bands else f'{r.end - r.bands[0].start:.4f}'}</td></tr>"
        for r in rows
    )
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:20px}} td,th{{padding:2px 10px;text-align:left}}
table{{border-collapse:collapse}} tr:nth-child(even){{background:#f4f4f4}}</style></head>
<body><h2>{html.escape(title)}</h2><p>{legend}</p>
{svg(rows)}
<h3>Requests</h3><table><tr><th>request</th><th>final state</th><th>reason</th><th>output tokens</th>
<th>seconds from arrival to end</th></tr>{table}</table></body></html>
"""
    path.write_text(page, encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hispec trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="a JSON-lines log (hispec generate --log-json FILE)")
    parser.add_argument("--out-png", help="default: the log's name with .png")
    parser.add_argument("--out-html", help="default: the log's name with .html")
    parser.add_argument("-v", "--verbose", action="store_true", help="print an error's traceback too")
    args = parser.parse_args(argv)
    log_path = Path(args.log)
    rows = build_rows(read_json_lines(log_path))
    if not rows:
        print(f"hispec trace: no lifecycle events in {log_path}")
        return 1
    title = f"hispec request timeline: {len(rows)} requests ({log_path.name})"
    png = Path(args.out_png) if args.out_png else log_path.with_suffix(".png")
    page = Path(args.out_html) if args.out_html else log_path.with_suffix(".html")
    write_html(rows, page, title)  # needs nothing beyond the standard library
    try:
        import matplotlib  # noqa: F401 -- only to know whether the PNG can be drawn
    except ImportError:
        print(f"wrote {page}")
        print(
            "hispec trace: no PNG: matplotlib is not installed (pip install matplotlib, or the "
            "`bench` extra)",
            file=sys.stderr,
        )
        return 2 if args.out_png else 0  # a PNG asked for by name and not written is a failure
    write_png(rows, png, title)
    print(f"wrote {png} and {page}")
    return 0
