"""report.html: one self-contained page (PNGs and plotly's JavaScript inline) with the summary
tables, the plots and an interactive timeline per run (without plotly: none).
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from lab.report.timeline import LANES, Story


def timeline_figure(stories: list[Story], steps, title: str):
    """A plotly figure: one row per request, one trace per lane (the legend toggles
    lanes), the step boundaries as alternating bands in a row of their own above."""
    import plotly.graph_objects as go

    fig = go.Figure()
    ids = [st.label for st in stories]
    story_text = {st.request_id: "<br>".join(html.escape(x) for x in st.lines) for st in stories}
    lo = min((s[1] for st in stories for s in st.segments), default=0.0)
    hi = max((s[2] for st in stories for s in st.segments), default=1.0)
    least = (hi - lo) * 1e-4
    for lane, colour in LANES.items():
        xs, bases, ys, texts = [], [], [], []
        for st in stories:
            for k, t0, t1, text in st.segments:
                if k == lane:
                    xs.append(max(t1 - t0, least))
                    bases.append(t0)
                    ys.append(st.label)
                    texts.append(f"<b>{html.escape(text)}</b><br>{story_text[st.request_id]}")
        if xs:
            fig.add_trace(
                go.Bar(
                    x=xs, base=bases, y=ys, orientation="h", name=lane, marker_color=colour,
                    hovertext=texts, hoverinfo="text", width=0.7,
                )
            )  # fmt: skip
    t = steps["time_s"].to_numpy(dtype=float)
    d = steps["duration_s"].to_numpy(dtype=float)
    sel = [k for k in range(len(t)) if t[k] + d[k] >= lo and t[k] <= hi][:20000]
    fig.add_trace(
        go.Bar(
            x=[d[k] for k in sel], base=[t[k] for k in sel], y=["steps"] * len(sel),
            orientation="h", name="steps", width=0.8,
            marker_color=["#555555" if k % 2 else "#cccccc" for k in sel],
            hovertext=[f"step {k:,}: {t[k]:.4f}-{t[k] + d[k]:.4f} s" for k in sel],
            hoverinfo="text",
        )
    )  # fmt: skip
    fig.update_layout(
        title=title,
        barmode="overlay",
        height=160 + 28 * (len(ids) + 1),
        xaxis_title="time (s): drag to zoom into steps, double-click to reset",
        yaxis={"categoryorder": "array", "categoryarray": ["steps", *ids][::-1]},
        legend={"orientation": "h", "y": -0.25},
        margin={"l": 70, "r": 20, "t": 50, "b": 40},
    )
    return fig


def write_html(
    path: Path,
    title: str,
    intro: str,
    tables: list[tuple[str, str]],
    images: list[tuple[Path, str]],
    timelines: list,
) -> None:
    """Write the page: ``tables`` (caption, html), ``images`` (PNG path, caption),
    ``timelines`` (plotly figures; empty without plotly)."""
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1400px;margin:auto;padding:1em}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
        "padding:2px 6px;text-align:right}th{background:#f3f3f3}img{max-width:100%}"
        "pre{background:#f7f7f7;padding:.5em}</style></head><body>",
        f"<h1>{html.escape(title)}</h1><p>{intro}</p>",
    ]
    for caption, table in tables:
        parts += [f"<h2>{html.escape(caption)}</h2>", table]
    for png, caption in images:
        data = base64.b64encode(png.read_bytes()).decode()
        parts += [
            f"<h2>{html.escape(caption)}</h2>",
            f"<img alt='{html.escape(caption)}' src='data:image/png;base64,{data}'>",
        ]
    parts.append("<h2>Request timelines (interactive)</h2>")
    if timelines:
        import plotly.io as pio

        for i, fig in enumerate(timelines):
            parts.append(
                pio.to_html(
                    fig,
                    full_html=False,
                    include_plotlyjs=(i == 0),
                    config={"responsive": True},
                    div_id=f"timeline-{i}",  # not a random id: reruns write the same bytes
                )
            )
    else:
        parts.append(
            "<p>plotly is not installed: no interactive timeline (pip install plotly).</p>"
        )
    parts.append("</body></html>")
    path.write_text("\n".join(parts))


def plotly_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("plotly") is not None
