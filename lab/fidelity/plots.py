"""The sim side's figures: per-step error CDFs by step kind, and engine vs simulator CDFs."""

from __future__ import annotations

from pathlib import Path


def plots(steps, cdfs, out_dir: Path) -> None:
    """Write ``heldout_step_error.png`` (per step kind CDF of ``steps.err``) and
    ``heldout_cdfs.png`` (TTFT and E2E CDFs; ``cdfs``: (window, load, policy) -> metric ->
    (engine, sim) samples) into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for kind, g in steps.groupby("kind"):
        e = np.sort(g.err.to_numpy() * 100)
        ax.plot(e, np.linspace(0, 1, len(e)), label=f"{kind} ({len(e):,} steps)")
    ax.set_xlim(-40, 40)
    ax.axvline(0, color="k", lw=0.5)
    ax.set_xlabel("per-step error, calibrated prediction vs engine (%)")
    ax.set_ylabel("fraction of engine steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "heldout_step_error.png", dpi=110)
    plt.close(fig)
    slices = sorted({k[0] for k in cdfs})
    loads = sorted({k[1] for k in cdfs})
    fig, axes = plt.subplots(
        2 * len(slices), len(loads), figsize=(3 * len(loads), 2.6 * 2 * len(slices)),
        squeeze=False,
    )  # fmt: skip
    for (sl, load, policy), d in cdfs.items():
        for k, m in enumerate(("ttft_s", "e2e_s")):
            ax = axes[2 * slices.index(sl) + k, loads.index(load)]
            real, simd = d[m]
            (line,) = ax.plot(np.sort(real), np.linspace(0, 1, len(real)), label=f"{policy}")
            ax.plot(np.sort(simd), np.linspace(0, 1, len(simd)), "--", color=line.get_color())
            ax.set_xscale("log")
            ax.set_title(f"{sl} {load:g}x: {m[:-2].upper()} (s)", fontsize=8)
            ax.grid(alpha=0.3)
            ax.tick_params(labelsize=6)
    axes[0, 0].legend(fontsize=6, title="solid engine, dashed sim", title_fontsize=6)
    fig.tight_layout()
    fig.savefig(out_dir / "heldout_cdfs.png", dpi=90)
    plt.close(fig)
