"""The results folder's plots (PNG, matplotlib):

* one colour per policy in every plot (p50 solid, p99 dashed, p99.9 dotted, max dash-dot),
  with markers and nested line widths so that identical policies do not hide each other;
* latency against the offered load (req/s of the trace as replayed), with throughput,
  goodput and SLO attainment in panels of their own;
* CDFs and over-time plots with one row or column per load;
* over-time bins hold the time average of the steps covering them (:func:`over_time`);
* seconds for TTFT and E2E, milliseconds for TPOT and ITL.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from sched_lab.results.metrics import DECODE_COLUMNS, cdf_points, decode_output_tokens
from sched_lab.results.names import LATENCIES as NAMES
from sched_lab.results.names import band_name

TIME_BINS = 120
COLOURS = ("#0072b2", "#d55e00", "#009e73", "#cc79a7", "#e69f00", "#56b4e9", "#f0e442", "#000")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = {"p50": "-", "p99": "--", "p99.9": ":", "max": "-."}
# (vLLM's metric, title, unit shown, scale from seconds); names and titles: results/names.py
LATENCIES = tuple(
    (metric, NAMES[metric][0], unit, scale)
    for metric, unit, scale in (("ttft", "s", 1.0), ("tpot", "ms", 1e3), ("itl", "ms", 1e3),
                                ("e2el", "s", 1.0))
)  # fmt: skip


def policy_styles(runs) -> dict[str, dict]:
    """policy -> colour, marker, line width, marker size and legend label, in first-seen order;
    widths and sizes shrink policy by policy, and a policy whose results equal an earlier one's
    at every load says so in its label."""
    out: dict[str, dict] = {}
    seen: dict[tuple, str] = {}
    for i, policy in enumerate(dict.fromkeys(r.policy for r in runs)):
        key = tuple(_fingerprint(r) for r in runs if r.policy == policy)
        label = policy if key not in seen else f"{policy} (= {seen[key]}: same results)"
        seen.setdefault(key, policy)
        out[policy] = policy_style(i, label)
    return out


def policy_style(i: int, label: str) -> dict:
    """The ``i``-th policy's colour, marker, line width and marker size (both shrinking with
    ``i``, so that a later policy's identical line stays visible inside an earlier one's)."""
    return {
        "color": COLOURS[i % len(COLOURS)],
        "marker": MARKERS[i % len(MARKERS)],
        "lw": max(3.6 - 1.1 * i, 1.0),
        "ms": max(9.0 - 2.5 * i, 3.5),
        "label": label,
    }


def log_axis(ax, which: str = "y") -> None:
    """Put ``ax``'s ``which`` axis ("x" or "y") on a log scale labelled in plain numbers
    (0.2, 0.5, 1, 2, 5, 10, not powers of ten), ticked more densely the fewer decades it
    spans. Call it after plotting: it reads the axis limits."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis = ax.yaxis if which == "y" else ax.xaxis
    (ax.set_yscale if which == "y" else ax.set_xscale)("log")
    lo, hi = sorted(ax.get_ylim() if which == "y" else ax.get_xlim())
    decades = np.log10(hi / lo) if lo > 0 else 99.0
    if decades < 1.3:
        subs: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    else:
        subs = (1.0, 2.0, 5.0) if decades < 2.5 else (1.0,)
    axis.set_major_locator(LogLocator(base=10, subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: plain_number(v)))
    axis.set_minor_formatter(NullFormatter())


def rate_scale_axis(ax, offered, scales) -> None:
    """A secondary x axis on top in rate_scale, when ``offered`` (req/s, the primary x) is one
    multiple of ``scales`` at every point (one trace, rate-scaled)."""
    pairs = [(o, s) for o, s in zip(offered, scales) if np.isfinite(o) and s and s > 0]
    ratios = [o / s for o, s in pairs]
    if not ratios or max(ratios) - min(ratios) > 1e-6 * max(ratios):
        return
    k = float(np.median(ratios))
    top = ax.secondary_xaxis("top", functions=(lambda x: x / k, lambda x: x * k))
    top.set_xlabel("rate_scale (x the trace's rate)", fontsize=8)
    top.tick_params(labelsize=8)


def plain_number(v: float) -> str:
    """A tick label: ``0.05``, ``2``, ``1,000``."""
    return f"{v:,.0f}" if v >= 1000 else f"{v:g}"


def _fingerprint(run) -> tuple:
    """What two runs at the same load must share to be drawn as the same results."""
    v = run.vllm or {}
    keys = [k for k in sorted(v) if k.endswith(("_ms", "throughput"))]
    return (run.rate_scale, *(v[k] for k in keys if isinstance(v[k], (int, float))))


def load_title(run) -> str:
    """``rate_scale 2 (11.04 req/s offered)``: a run's load."""
    rate = run.vllm.get("request_rate") if run.vllm else None
    offered = f" ({rate:.2f} req/s offered)" if rate else ""
    return f"rate_scale {run.rate_scale:g}{offered}"


def kv_device(cfg) -> str:
    """Where the KV cache lives, for axis labels: the engine's device or the simulated
    hardware preset."""
    from sched_lab.setup import setup_for

    return setup_for(cfg).kv_device()


def plots(folder: Path, runs, cfg, device: str | None = None) -> list[tuple[str, str]]:
    """Write the PNGs into ``folder``; returns (file name, caption) pairs for report.md.
    ``device``: where the KV cache lives, as an axis names it (default: :func:`kv_device`
    of ``cfg``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = policy_styles(runs)
    scales = sorted({r.rate_scale for r in runs})
    by_scale = {s: [r for r in runs if r.rate_scale == s] for s in scales}
    out = []

    # ---- CDFs: one row per load
    fig, axes = plt.subplots(len(scales), 4, figsize=(15, 3.4 * len(scales)), squeeze=False)
    for row, s in zip(axes, scales):
        for ax, (metric, title, unit, k) in zip(row, LATENCIES):
            for r in by_scale[s]:
                kw = {"color": styles[r.policy]["color"], "lw": styles[r.policy]["lw"] * 0.6}
                if metric == "itl":  # the tail is the story: 1 - CDF on a log scale
                    if r.itl_tail_s is not None and r.itl_tail_s.shape[1]:
                        above, x = r.itl_tail_s
                        ax.plot(x * k, above, **kw)
                        ax.plot([x[-1] * k], [above[-1]], marker="x", ms=7, ls="", **kw)  # max
                    continue
                x = cdf_points(r.requests[NAMES[metric][1]].to_numpy(float))
                if len(x):
                    ax.plot(x * k, np.linspace(0, 1, len(x)), **kw)
            _log_if_wide(ax)
            load = load_title(by_scale[s][0])
            if metric == "itl" and ax.get_lines():
                ax.set_yscale("log")
                for q, name in ((1e-2, "p99"), (1e-3, "p99.9")):
                    ax.axhline(q, color="grey", lw=0.6, ls=":")
                    ax.text(ax.get_xlim()[0], q, f" {name}", va="bottom", fontsize=7, color="grey")
            if metric == "itl":
                ax.set_title(f"ITL tail (x: max), {load}", fontsize=9)
                ax.set_ylabel("fraction of gaps longer")
            else:
                ax.set_title(f"{title} CDF, {load}", fontsize=9)
                ax.set_ylabel("fraction of finished requests")
            ax.set_xlabel(f"{title} ({unit}{', log scale' if ax.get_xscale() == 'log' else ''})")
            ax.grid(alpha=0.3)
    _legend(fig, styles, lines=False, top=0.35)
    out.append(_save(fig, folder, "latency_cdf.png", "Latency CDFs per policy, one row per load"))

    if any(_num_steps(r) for r in runs):  # a served run has no steps
        device = kv_device(cfg) if device is None else device
        out.append(_over_time(folder, device, scales, by_scale, styles, plt))

    if any(r.result.prefix_caching for r in runs):
        out.append(_prefix_cache(folder, by_scale, styles, plt))
    if len(scales) > 1:
        out.append(_vs_load(folder, runs, styles, plt))
    return out


def _over_time(folder, device, scales, by_scale, styles, plt) -> tuple[str, str]:
    """Throughput, KV use and queue over time (from the steps), one column per load;
    ``device``: where the KV cache lives (:func:`kv_device`)."""
    fig, axes = plt.subplots(
        3, len(scales), figsize=(max(11, 5.5 * len(scales)), 9), sharex="col", squeeze=False
    )
    for col, s in enumerate(scales):
        for r in by_scale[s]:
            t, tput, kv, queue = over_time(r)
            kw = {"color": styles[r.policy]["color"], "lw": styles[r.policy]["lw"] * 0.5}
            axes[0, col].plot(t, tput, **kw)
            axes[1, col].plot(t, kv * 100, **kw)
            axes[2, col].plot(t, queue, **kw)
        axes[0, col].set_title(load_title(by_scale[s][0]), fontsize=10)
        axes[2, col].set_xlabel("time (s)")
        blocks = total_blocks(by_scale[s][0])
        axes[1, col].set_ylabel(f"KV blocks used (% of {blocks:,})\non {device}")
        axes[1, col].set_ylim(0, 105)
        axes[0, col].set_ylabel("output tokens / s")
        axes[2, col].set_ylabel("waiting + swapped\nrequests")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    fig.suptitle(
        f"Throughput, KV use and queue over time ({TIME_BINS} bins per load; each bin the "
        "time average of the steps covering it)",
        fontsize=10,
    )
    _legend(fig, styles, lines=False, left=1.0, top=0.7, hgap=0.2, wgap=1.1)
    return _save(fig, folder, "over_time.png", "Throughput, KV usage and queue length over time")


def _prefix_cache(folder, by_scale, styles, plt) -> tuple[str, str]:
    """Prefix cache over time, one column per load: the share of prompt tokens served from the
    cache per bin, and the GPU blocks holding a key."""
    scales = list(by_scale)
    fig, axes = plt.subplots(
        2, len(scales), figsize=(max(11, 5.5 * len(scales)), 6), sharex="col", squeeze=False
    )
    for col, scale in enumerate(scales):
        for r in by_scale[scale]:
            if not r.result.prefix_caching:
                continue
            centres, hit, keyed = prefix_series(r)
            kw = {"color": styles[r.policy]["color"], "lw": styles[r.policy]["lw"] * 0.5}
            axes[0, col].plot(centres, hit, **kw)
            axes[1, col].plot(centres, keyed, **kw)
        axes[0, col].set_title(load_title(by_scale[scale][0]), fontsize=10)
        axes[0, col].set_ylabel("prompt tokens cached (%)")
        axes[1, col].set_ylabel("KV blocks holding a key (%)")
        axes[1, col].set_xlabel("time (s)")
        for ax in axes[:, col]:
            ax.grid(alpha=0.3)
    fig.suptitle(f"Prefix cache: hit rate and keyed blocks over time ({TIME_BINS} bins)")
    _legend(fig, styles, lines=False, top=0.7, hgap=0.2, wgap=1.1)
    return _save(
        fig, folder, "prefix_cache.png", "Prefix cache hit rate and cached blocks over time"
    )


def _vs_load(folder, runs, styles, plt) -> tuple[str, str]:
    slo = bool(runs[0].summary.get("slo"))
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.6))
    panels = list(axes.flat)
    for policy, st in styles.items():
        rs = sorted((r for r in runs if r.policy == policy), key=lambda r: r.rate_scale)
        x = [_offered(r) for r in rs]
        kw = {"color": st["color"], "marker": st["marker"], "ms": st["ms"], "lw": st["lw"]}
        for ax, (name, title, unit, _) in zip(panels, LATENCIES):
            shown = ("p50", "p99", "p99.9", "max") if name == "itl" else ("p50", "p99")
            for p in shown:
                y = [
                    r.vllm.get(f"{p}_{name}_ms", np.nan) / (1e3 if unit == "s" else 1.0) for r in rs
                ]
                ax.plot(x, y, ls=STYLES[p], alpha=0.85, **kw)
                _band(ax, x, rs, f"{p}_{name}_ms", st["color"], 1e-3 if unit == "s" else 1.0)
            ax.set_title(f"{title} ({', '.join(shown)})", fontsize=10)
            ax.set_ylabel(f"{title} ({unit}, log scale)")
        panels[4].plot(x, [r.summary["request_throughput"] for r in rs], **kw)
        panels[5].plot(x, [r.summary["output_throughput"] for r in rs], **kw)
        _band(panels[4], x, rs, "request_throughput", st["color"])
        _band(panels[5], x, rs, "output_throughput", st["color"])
        if slo:
            panels[6].plot(x, [r.summary["request_goodput"] for r in rs], **kw)
            panels[7].plot(x, [100 * r.summary["slo_attainment"] for r in rs], **kw)
            _band(panels[6], x, rs, "request_goodput", st["color"])
            _band(panels[7], x, rs, "slo_attainment", st["color"], 100.0)
    top = max(_offered(r) for r in runs)
    panels[4].plot([0, top], [0, top], color="grey", lw=0.8, ls=":", label="= offered")
    panels[4].legend(fontsize=8, loc="upper left")
    panels[4].set(title="Achieved request throughput", ylabel="finished requests / s")
    panels[5].set(title="Output token throughput", ylabel="output tokens / s")
    if slo:
        from sched_lab.report.terminal import slo_text

        panels[6].set(
            title=f"Goodput ({slo_text(runs[0].summary['slo'])})",
            ylabel="requests / s meeting every SLO",
        )
        panels[7].set(
            title="SLO attainment", ylabel="% of requests meeting every SLO", ylim=(0, 102)
        )
    else:
        for ax in panels[6:]:
            ax.text(0.5, 0.5, "no SLOs set\n(slo: in the YAML)", ha="center", va="center",
                    transform=ax.transAxes, color="grey")  # fmt: skip
            ax.set_xticks([])
            ax.set_yticks([])
    for ax in panels[:4]:
        log_axis(ax)
    for ax in panels:
        ax.set_xlabel("offered load (req/s)")
        ax.grid(alpha=0.3)
        rate_scale_axis(ax, [_offered(r) for r in runs], [r.rate_scale for r in runs])
    _legend(fig, styles, lines=True, top=0.9, hgap=1.3)
    return _save(
        fig, folder, "latency_vs_load.png", "Latency, throughput and goodput vs offered load"
    )


def _band(ax, x, runs, key: str, color, scale: float = 1.0) -> None:
    """Shade the 90% band of ``key`` over seeded replicas (runs with ``seeds``), if any."""
    bands = [r.summary.get(band_name(key)) for r in runs]
    if any(b is None for b in bands):
        return
    lo, hi = (np.array([b[i] for b in bands], float) * scale for i in (0, 1))
    ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)


def _offered(run) -> float:
    rate = run.vllm.get("request_rate") if run.vllm else None
    return float(rate) if rate else float(run.rate_scale)


def _log_if_wide(ax) -> None:
    lines = [ln.get_xdata() for ln in ax.get_lines() if len(ln.get_xdata())]
    if lines:
        lo = min(max(float(np.min(x)), 1e-9) for x in lines)
        if max(float(np.max(x)) for x in lines) > 10 * lo:
            log_axis(ax, "x")  # a log axis only pays over a decade


def _legend(fig, styles, lines: bool, **space: float) -> None:
    from matplotlib.lines import Line2D

    handles = [
        Line2D([], [], color=s["color"], marker=s["marker"] if lines else None, lw=2,
               label=s["label"])
        for s in styles.values()
    ]  # fmt: skip
    if lines:
        handles += [Line2D([], [], color="black", ls=ls, label=p) for p, ls in STYLES.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=9, frameon=False)
    margins(fig, **space)


def margins(
    fig,
    left: float = 0.85,
    right: float = 0.25,
    top: float = 0.55,
    bottom: float = 1.0,
    wgap: float = 0.85,
    hgap: float = 0.85,
) -> None:
    """Fixed margins and gaps between panels, in inches (a legend row at the bottom): drawn
    once, where matplotlib's tight layout draws every label to measure it first."""
    w, h = fig.get_size_inches()
    rows, cols = fig.axes[0].get_subplotspec().get_gridspec().get_geometry()
    inner_w = w - left - right
    inner_h = h - top - bottom
    panel_w = (inner_w - wgap * (cols - 1)) / cols
    panel_h = (inner_h - hgap * (rows - 1)) / rows
    fig.subplots_adjust(
        left=left / w, right=1 - right / w, top=1 - top / h, bottom=bottom / h,
        wspace=wgap / panel_w, hspace=hgap / panel_h,
    )  # fmt: skip


def run_series(run) -> dict:
    """What the plots read of a run's steps (its step count, :func:`over_time`,
    :func:`total_blocks`, :func:`prefix_series`), to keep when the steps are released
    (:attr:`sched_lab.results.run.Run.plot_series`)."""
    return {
        "num_steps": _num_steps(run),
        "over_time": over_time(run),
        "total_blocks": total_blocks(run),
        "prefix": prefix_series(run) if run.result.prefix_caching else None,
    }


def _series(run, key: str):
    series = getattr(run, "plot_series", None)
    return None if series is None else series[key]


def _num_steps(run) -> int:
    kept = _series(run, "num_steps")
    return run.result.num_steps if kept is None else kept


def prefix_series(run) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prefix cache of a run in bins: centres (s), % of prompt tokens served from the cache,
    % of GPU blocks holding a key (time average)."""
    kept = _series(run, "prefix")
    if kept is not None:
        return kept

    def amounts(s: dict, start: np.ndarray, end: np.ndarray) -> list[np.ndarray]:
        keyed = s["kv_cached_blocks"] / max(run.result.num_gpu_blocks, 1)
        return [
            s["num_cached_tokens"].astype(float),
            s["num_prefill_tokens"].astype(float),
            keyed * (end - start),  # _bin_mean's amount
        ]

    columns = ("kv_cached_blocks", "num_cached_tokens", "num_prefill_tokens")
    edges, (cached, fed, keyed) = _binned_steps(run, amounts, columns)
    centres = (edges[:-1] + edges[1:]) / 2
    with np.errstate(invalid="ignore", divide="ignore"):
        hit = 100 * cached / (cached + fed)
    return centres, hit, 100 * (keyed / np.diff(edges))


def over_time(run) -> tuple[np.ndarray, ...]:
    """Binned series of a run: bin centres (s), output tokens/s, KV fraction used, waiting +
    swapped requests. KV use and the queue hold a step's value while it runs (0 while idle);
    output tokens are spread evenly over their step."""
    kept = _series(run, "over_time")
    if kept is not None:
        return kept
    blocks = max(total_blocks(run), 1)

    def amounts(s: dict, start: np.ndarray, end: np.ndarray) -> list[np.ndarray]:
        dur = end - start
        queue = (s["num_waiting"] + s["num_swapped"]).astype(float)
        # _bin_mean's amounts (value times duration), then decode tokens spread over each step
        return [(s["kv_used_blocks"] / blocks) * dur, queue * dur, decode_output_tokens(s)]

    columns = ("num_waiting", "num_swapped", "kv_used_blocks", *DECODE_COLUMNS)
    edges, (kv, queue, tokens) = _binned_steps(run, amounts, columns)
    width = edges[1] - edges[0]
    kv, queue = kv / np.diff(edges), queue / np.diff(edges)
    # first tokens at their times
    first = run.requests["first_token_s"].to_numpy(float)
    first = first[np.isfinite(first)]
    tokens += np.histogram(first, edges)[0]
    return (edges[:-1] + edges[1:]) / 2, tokens / width, kv, queue


STEP_ROWS = 1 << 18  # steps whose columns _binned_steps makes at a time


def _binned_steps(
    run, amounts, columns: tuple[str, ...], rows: int | None = None
) -> tuple[np.ndarray, list[np.ndarray]]:
    """(edges, sums): :data:`TIME_BINS` bins from 0 to the last step's end (at least 1 s),
    and for each of ``amounts(steps, start, end)`` (arrays, one value a step, from a dict of
    step columns, ``time_s``, ``duration_s`` and those of ``columns`` the run has, and the
    steps' starts and ends) its :func:`_spread` over the steps.

    Steps whose starts and ends both strictly increase (one replica's) are read ``rows`` at
    a time (:class:`PartSpread`); otherwise (a cluster's, whose replicas' steps overlap) the
    whole columns at once. Either way the sums are the same to the last bit. ``rows``:
    default :data:`STEP_ROWS`."""
    res, rows = run.result, rows or STEP_ROWS
    n = res.num_steps
    if n:
        last = res.step_rows(n - 1, n, ("time_s", "duration_s"))
        edges = np.linspace(0.0, max(float((last["time_s"] + last["duration_s"])[0]), 1.0),
                            TIME_BINS + 1)  # fmt: skip
        spreads: list[PartSpread] = []
        for lo in range(0, n, rows):
            s = res.step_rows(lo, min(lo + rows, n), ("time_s", "duration_s", *columns))
            start = s["time_s"]
            end = start + s["duration_s"]
            values = amounts(s, start, end)
            spreads = spreads or [PartSpread(edges) for _ in values]
            if not all(p.add(start, end, v) for p, v in zip(spreads, values)):
                break  # not in order: the whole columns below
        else:
            return edges, [p.sums() for p in spreads]
    s = res.steps
    start = s["time_s"]
    end = start + s["duration_s"]
    edges = np.linspace(0.0, float(end.max(initial=1.0)), TIME_BINS + 1)
    return edges, [_spread(start, end, v, edges) for v in amounts(s, start, end)]


class PartSpread:
    """:func:`_spread` of steps given in parts, in order (:meth:`add`), whose starts and ends
    both strictly increase: the same sums to the last bit (numpy's running sums are
    sequential, so each part's continue the last part's), with temporaries of a part's size.
    """

    def __init__(self, edges: np.ndarray) -> None:
        self.edges = edges
        # at each edge: running sums (rate * start, rate; rate * end, rate) of the steps
        # started (ended) by it: _spread's cs[i], cr_s[i], ce[j], cr_e[j]
        self._at = np.zeros((4, len(edges)))
        self._carry: np.ndarray | None = None  # the four running sums after the last part
        self._last = (-np.inf, -np.inf)  # the last part's last start and end

    def add(self, start: np.ndarray, end: np.ndarray, amount: np.ndarray) -> bool:
        """Add the next steps (``amount[i]`` spread over [start[i], end[i])); False (adding
        nothing) where a start or an end does not exceed the one before."""
        if not len(start):
            return True
        if not (start[0] > self._last[0] and end[0] > self._last[1]) or not (
            _increasing(start) and _increasing(end)
        ):
            return False
        self._last = (float(start[-1]), float(end[-1]))
        rate = amount / np.maximum(end - start, 1e-12)
        i = np.searchsorted(start, self.edges, "right")  # this part's steps started by x
        j = np.searchsorted(end, self.edges, "right")
        carry = self._carry
        sums = [
            _running(rate * start, None if carry is None else carry[0]),
            _running(rate, None if carry is None else carry[1]),
            _running(rate * end, None if carry is None else carry[2]),
            _running(rate, None if carry is None else carry[3]),
        ]
        for row, (k, c) in enumerate(zip((i, i, j, j), sums)):
            hit = k > 0  # else the sum is the one before this part's steps, kept
            self._at[row, hit] = c[k[hit] - 1]
        self._carry = np.array([c[-1] for c in sums])
        return True

    def sums(self) -> np.ndarray:
        """:func:`_spread`'s result: the amount delivered in each bin."""
        cs, cr_s, ce, cr_e = self._at
        x = self.edges
        return np.diff((x * cr_s - cs) - (x * cr_e - ce))


def _increasing(t: np.ndarray) -> bool:
    return len(t) < 2 or bool((t[1:] > t[:-1]).all())


def _running(x: np.ndarray, carry: float | None) -> np.ndarray:
    """The running sums of ``x`` after a sum of ``carry`` so far (None: the first values),
    each value added to the sum before, as ``np.cumsum`` of the whole does."""
    if carry is None:
        return np.cumsum(x)
    out = np.empty(len(x) + 1)
    out[0] = carry
    out[1:] = x
    return np.cumsum(out, out=out)[1:]


def total_blocks(run) -> int:
    """GPU KV blocks of the run: one replica's times the replicas."""
    kept = _series(run, "total_blocks")
    if kept is not None:
        return kept
    replica = run.result.steps.get("replica")
    n = len(np.unique(replica)) if replica is not None and len(replica) else 1
    return run.result.num_gpu_blocks * n


def _bin_mean(start: np.ndarray, end: np.ndarray, value: np.ndarray, edges) -> np.ndarray:
    """Mean over each bin of the function equal to ``value[i]`` over [start[i], end[i]), 0
    between steps."""
    return _spread(start, end, value * (end - start), edges) / np.diff(edges)


def _spread(start, end, amount, edges) -> np.ndarray:
    """``amount[i]`` spread evenly over [start[i], end[i]), summed per bin."""
    if len(start) == 0:
        return np.zeros(len(edges) - 1)
    rate = amount / np.maximum(end - start, 1e-12)
    # cumulative amount delivered by time x: sum over steps of rate * overlap([start, end), [0, x))
    start, rate_s = _in_order(start, rate)
    cs = _cumsum0(rate_s * start)
    cr_s = _cumsum0(rate_s)
    del rate_s
    end, rate_e = _in_order(end, rate)
    ce = _cumsum0(rate_e * end)
    cr_e = _cumsum0(rate_e)
    del rate_e, rate
    i = np.searchsorted(start, edges, "right")  # steps started by x
    j = np.searchsorted(end, edges, "right")  # steps ended by x
    # started: rate * (x - start); minus for the ended: rate * (x - end)
    delivered = (edges * cr_s[i] - cs[i]) - (edges * cr_e[j] - ce[j])
    return np.diff(delivered)


def _in_order(t: np.ndarray, rate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``t`` and ``rate`` ordered by ``t`` (``np.argsort``); as they are where ``t`` strictly
    increases (steps in order: the same order, without the sort and its copies)."""
    if len(t) < 2 or bool((t[1:] > t[:-1]).all()):
        return t, rate
    order = np.argsort(t)
    return t[order], rate[order]


def _cumsum0(x: np.ndarray) -> np.ndarray:
    """0, then the running sums of ``x``."""
    out = np.empty(len(x) + 1)
    out[0] = 0.0
    np.cumsum(x, out=out[1:])
    return out


def _save(fig, folder: Path, name: str, caption: str) -> tuple[str, str]:
    import matplotlib.pyplot as plt

    fig.savefig(folder / name, dpi=100)
    plt.close(fig)
    return name, caption
