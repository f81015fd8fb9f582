"""report.html: one self-contained page, report.md rendered (its PNGs inline), the table of
every statistic and an interactive timeline per run (without plotly: none).

Nothing is loaded from the network. plotly's JavaScript is inlined once, gzip-compressed
(base64) and unpacked by the browser (``DecompressionStream``); each timeline is a JSON
figure, packed the same way, drawn after it loads. A timeline's steps row holds at most
:data:`MAX_STEP_BARS` bars (consecutive steps merged past that), so a long run's page stays
small.
"""

from __future__ import annotations

import base64
import functools
import gzip
import html
import json
from pathlib import Path

from sched_lab.report.timeline import LANES, Story, step_runs, steps_in_view

MAX_STEP_BARS = 3000  # bars of a timeline's steps row: about what a 1,400 px page shows
DIGITS = 6  # seconds in the figures: microseconds
PACK_LEVEL = 4  # gzip's level: several times faster than 9 on plotly.js and on the figures'
# JSON, for a few percent more bytes

# Unpacks plotly.js, then draws every figure (each packed JSON: {"div", "data", "layout"}).
LOADER = """<script>
(async () => {
  const unpack = async (el) => {
    const bytes = Uint8Array.from(atob(el.textContent), (c) => c.charCodeAt(0));
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return await new Response(stream).text();
  };
  const code = document.createElement("script");
  code.text = await unpack(document.getElementById("plotly-gz"));
  document.head.appendChild(code);
  for (const el of document.querySelectorAll("script.timeline")) {
    const fig = JSON.parse(await unpack(el));
    Plotly.newPlot(fig.div, fig.data, fig.layout, {responsive: true});
  }
})();
</script>"""


def timeline_figure(stories: list[Story], steps, title: str) -> dict:
    """A plotly figure as plain JSON-ready data (``{"data", "layout"}``; built without
    plotly's validating objects): one row per request, one trace per lane (the legend
    toggles lanes), the step boundaries as alternating bands in a row of their own above."""
    ids = [st.label for st in stories]
    story_text = {st.request_id: "<br>".join(html.escape(x) for x in st.lines) for st in stories}
    lo = min((s[1] for st in stories for s in st.segments), default=0.0)
    hi = max((s[2] for st in stories for s in st.segments), default=1.0)
    least = (hi - lo) * 1e-4
    told: set[str] = set()  # requests whose whole story one segment's hover already holds
    data = []
    for lane, colour in LANES.items():
        xs, bases, ys, texts = [], [], [], []
        for st in stories:
            for k, t0, t1, text in st.segments:
                if k == lane:
                    xs.append(round(max(t1 - t0, least), DIGITS))
                    bases.append(round(t0, DIGITS))
                    ys.append(st.label)
                    # the story once per request and lane; its other segments name the request
                    key = f"{lane}\0{st.request_id}"
                    more = story_text[st.request_id] if key not in told else st.label
                    told.add(key)
                    texts.append(f"<b>{html.escape(text)}</b><br>{more}")
        if xs:
            data.append(_bars(xs, bases, ys, lane, colour, texts, 0.7))
    data.append(_steps_row(steps, lo, hi))
    layout = {
        "title": {"text": title},
        "barmode": "overlay",
        "height": 160 + 28 * (len(ids) + 1),
        "xaxis": {"title": {"text": "time (s): drag to zoom into steps, double-click to reset"}},
        "yaxis": {"categoryorder": "array", "categoryarray": ["steps", *ids][::-1]},
        "legend": {"orientation": "h", "y": -0.25},
        "margin": {"l": 70, "r": 20, "t": 50, "b": 40},
    }
    return {"data": data, "layout": layout}


def _bars(xs, bases, ys, name: str, colour, texts, width: float) -> dict:
    """A horizontal plotly bar trace: bars of length ``xs`` from ``bases`` on rows ``ys``."""
    return {
        "type": "bar", "x": xs, "base": bases, "y": ys, "orientation": "h", "name": name,
        "marker": {"color": colour}, "hovertext": texts, "hoverinfo": "text", "width": width,
    }  # fmt: skip


def step_groups(n: int, most: int = MAX_STEP_BARS) -> list[tuple[int, int]]:
    """[first, last] step indices of the bars for ``n`` steps: one per step up to ``most``,
    else runs of ``ceil(n / most)`` consecutive steps (:func:`~sched_lab.report.timeline.
    step_runs`)."""
    first, last = step_runs(n, most)
    return list(zip(first.tolist(), last.tolist()))


def _steps_row(steps, lo: float, hi: float):
    """The steps in view of [lo, hi] (:func:`~sched_lab.report.timeline.steps_in_view`) as
    alternating bars (merged in runs past MAX_STEP_BARS)."""
    t = steps["time_s"].to_numpy(dtype=float)
    d = steps["duration_s"].to_numpy(dtype=float)
    sel = steps_in_view(t, d, lo, hi).tolist()
    xs, bases, texts, colours = [], [], [], []
    for i, (a, b) in enumerate(step_groups(len(sel))):
        first, last = sel[a], sel[b]
        start, end = t[first], t[last] + d[last]
        xs.append(round(end - start, DIGITS))
        bases.append(round(start, DIGITS))
        colours.append("#555555" if i % 2 else "#cccccc")
        which = f"step {first:,}" if a == b else f"steps {first:,}-{last:,} ({b - a + 1})"
        texts.append(f"{which}: {start:.4f}-{end:.4f} s")
    return _bars(xs, bases, ["steps"] * len(xs), "steps", colours, texts, 0.8)


def render_markdown(text: str, folder: Path) -> str:
    """report.md as HTML (CommonMark and tables; raw HTML escaped); an image that names a PNG
    of ``folder`` is inlined as a data URI."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(text)
    for tok in tokens:
        for child in tok.children or ():
            src = str(child.attrGet("src") or "")
            if child.type == "image" and src.endswith(".png") and (folder / src).is_file():
                data = base64.b64encode((folder / src).read_bytes()).decode()
                child.attrSet("src", f"data:image/png;base64,{data}")
    return md.renderer.render(tokens, md.options, {})


def write_html(
    path: Path,
    title: str,
    report_md: str,
    tables: list[tuple[str, str]],
    timelines: list,
    *,
    timelines_expected: bool = True,
) -> None:
    """Write the page beside report.md: ``report_md`` rendered, then ``tables`` (caption,
    html) and ``timelines`` (:func:`timeline_figure`'s). ``timelines_expected``: the runs have
    timelines (a cluster's have none), so a missing plotly is worth a line."""
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1400px;margin:auto;padding:1em}"
        "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
        "padding:2px 6px;text-align:right}th{background:#f3f3f3}img{max-width:100%}"
        "code{background:#f3f3f3;padding:0 .2em}pre{background:#f7f7f7;padding:.5em}</style>"
        "</head><body>",
        render_markdown(report_md, path.parent),
    ]
    for caption, table in tables:
        parts += [f"<h2>{html.escape(caption)}</h2>", table]
    if timelines:
        parts.append("<h2>Request timelines (interactive)</h2>")
        for i, fig in enumerate(timelines):
            spec = json.dumps({"div": f"timeline-{i}", **fig})
            parts += [
                f"<div id='timeline-{i}'></div>",
                f"<script type='application/octet-stream' class='timeline'>{_pack(spec)}</script>",
            ]
        parts += [
            f"<script id='plotly-gz' type='application/octet-stream'>{_packed_plotly()}</script>",
            LOADER,
        ]
    elif timelines_expected and not plotly_available():
        parts.append(
            "<p>plotly is not installed: no interactive timeline (pip install plotly).</p>"
        )
    parts.append("</body></html>")
    path.write_text("\n".join(parts))


def _pack(text: str, level: int = PACK_LEVEL) -> str:
    """``text`` gzip-compressed at ``level`` (no timestamp: reruns write the same bytes), in
    base64."""
    return base64.b64encode(gzip.compress(text.encode(), compresslevel=level, mtime=0)).decode()


@functools.cache
def _packed_plotly() -> str:
    """plotly.js as :func:`_pack` gives it, packed once a process (every page's bytes)."""
    from plotly.offline import get_plotlyjs

    return _pack(get_plotlyjs())


def plotly_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("plotly") is not None
