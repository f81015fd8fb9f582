"""Prompt-only engine steps of held-out archives by size, predicted with and without c12.

    python benchmarks/fidelity_eager_steps.py docs/fidelity_mooncake/heldout_mooncake_engine.tar.gz ...

For each archive (and its ``_repeat`` beside it): the calibrated model ``sched-lab fidelity
--sim`` fits (the archive's profile.csv plus its calibration replays), once as it is and once
with the paged prefill pairs' term c12 held at 0 (lab/sim/calibrated.py, module doc: the
model before that term). Every engine step of the evaluated windows (both passes) is
predicted from its own batch. Printed per archive and model: all steps' |error| median and
P90, and for prompt-only steps in bins of prompt tokens (<= 8,192: CUDA graphs; above:
eager) their count and the median of measured / predicted - 1 (positive: predicted short);
then the fitted c8 (pairs), c10 (eager slope) and c12.
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sched_lab.sim.calibrated as cal  # noqa: E402
from sched_lab.core.errors import ConfigError  # noqa: E402

BINS = ((0, 8192), (8192, 16384), (16384, 1 << 30))


class Refused(Exception):
    """One line for stderr: an archive that is missing or lacks what the fit needs."""


def unpack(archive: Path, out: Path) -> Path:
    """``archive`` and its ``_repeat`` beside it (if any) unpacked into ``out``, with the
    profile.csv and engine runs' steps.csv files found there. Raises Refused."""
    if not archive.is_file():
        raise Refused(f"{archive}: no such archive (expected a fidelity --engine .tar.gz)")
    for path in (archive, archive.with_name(archive.name.replace(".tar.gz", "_repeat.tar.gz"))):
        if path.exists():
            try:
                with tarfile.open(path) as tar:
                    tar.extractall(out, filter="data")
            except (tarfile.TarError, OSError) as e:
                raise Refused(f"{path}: not a readable .tar.gz ({type(e).__name__})") from None
    if next(out.rglob("profile.csv"), None) is None:
        raise Refused(f"{archive}: no profile.csv (expected a fidelity --engine archive)")
    if not list(out.glob("engine*/*/steps.csv")):
        raise Refused(f"{archive}: no engine*/*/steps.csv (no engine run to predict)")
    return out


def fit(data: pd.DataFrame, c12: bool) -> np.ndarray:
    """The model's coefficients; without ``c12``, every pair counted as varlen (the paged
    column all 0: the fit of the model before that term, c12 = 0)."""
    if c12:
        return cal.fit(data)
    paged = cal.paged_pairs
    cal.paged_pairs = lambda tokens, *_: np.zeros(np.shape(tokens), dtype=bool)
    try:
        return cal.fit(data)
    finally:
        cal.paged_pairs = paged


def main(argv: list[str]) -> int:
    """Exit status 0, or 2 with one line on stderr (a missing or unusable archive: then
    the archives before it have been printed)."""
    for archive in map(Path, argv or ["docs/fidelity_mooncake/heldout_mooncake_engine.tar.gz"]):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                report(archive, unpack(archive, Path(tmp)))
            except (Refused, ConfigError) as e:  # ConfigError: a damaged profile or steps.csv
                print(f"fidelity_eager_steps.py: {e}", file=sys.stderr)
                return 2
    return 0


def report(archive: Path, src: Path) -> None:
    """Print one archive's lines (module doc), unpacked in ``src``."""
    profile = next(src.rglob("profile.csv"))
    bs = cal.profile_block_size(profile)
    grid = cal.read_profile(profile)
    calib = [cal.read_replay_steps(f, bs) for f in sorted(src.glob("calibration/*/steps.csv"))]
    data = pd.concat([grid, *calib], ignore_index=True)
    runs = sorted(src.glob("engine*/*/steps.csv"))
    steps = pd.concat([cal.read_replay_steps(f, bs) for f in runs], ignore_index=True)
    y = steps["duration_s"].to_numpy()
    tokens = steps["num_prefill_tokens"].to_numpy()
    prompt_only = (steps["num_prefills"] > 0).to_numpy() & (steps["num_decodes"] == 0).to_numpy()
    print(f"{archive} ({len(steps):,} steps in {len(runs)} runs)")
    for name, with_c12 in (("without c12", False), ("with c12", True)):
        coef = fit(data, with_c12)
        ratio = y / (cal.design(steps) @ coef) - 1
        cells = [
            f"all {100 * np.median(abs(ratio)):.2f}% / {100 * np.percentile(abs(ratio), 90):.2f}%"
        ]
        for lo, hi in BINS:
            s = prompt_only & (tokens > lo) & (tokens <= hi)
            if s.any():
                top = "up" if hi >= 1 << 30 else f"{hi // 1024}k"
                cells.append(
                    f"prompt {lo // 1024}-{top}: {s.sum()} steps {100 * np.median(ratio[s]):+.1f}%"
                )
        cells.append(f"c8 {coef[cal._PAIRS] * 1e9:.3f} ns, c10 {coef[cal._EAGER] * 1e6:+.3f} us, "
                     f"c12 {coef[cal._PAGED] * 1e9:.3f} ns")  # fmt: skip
        print(f"  {name:12s} " + " | ".join(cells))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
