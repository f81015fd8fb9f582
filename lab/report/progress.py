"""Progress of the phases of a run: a tqdm bar on stderr on a terminal, else one INFO line
per phase on the ``sched_lab.report.progress`` logger when it ends.

    with Phase("fcfs: metrics", total=len(requests), unit="req") as phase:
        for i, r in enumerate(requests):
            ...
            phase.set(i + 1)
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("sched_lab.report.progress")


def seconds_text(s: float) -> str:
    """A wall time for a progress line: ``3.1 s`` from 0.1 s up, ``40 ms`` below (``0.0 s``
    would read as no time at all), ``< 1 ms`` below that."""
    if s >= 0.1:
        return f"{s:.1f} s"
    return f"{s * 1000:.0f} ms" if s >= 0.001 else "< 1 ms"


class Phase:
    """One phase: a bar while it runs (on a terminal), one log line when it ends well. A context
    manager, or ``start()`` then ``close()`` (idempotent).

    Args:
        name: what the phase does, e.g. ``"fcfs: replay 19,366 requests"``.
        total: units of work for the bar; None: a bar without an end.
        unit: the unit's name on the bar.
        bars: False: never a bar (``--no-progress``), only the log line.
    """

    def __init__(
        self, name: str, total: int | None = None, unit: str = "it", bars: bool = True
    ) -> None:
        self.name, self.total, self.unit = name, total, unit
        self.show_bar = bars and sys.stderr.isatty()
        self.bar = None
        self.t0: float | None = None

    def start(self) -> Phase:
        self.t0 = time.perf_counter()
        if self.show_bar:
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                desc=self.name,
                unit=self.unit,
                leave=True,
                mininterval=0.5,
                file=sys.stderr,
            )
        return self

    def set(self, done: int, note: str = "") -> None:
        """``done`` units of work finished so far; ``note`` shown after the bar."""
        if self.bar is not None:
            self.bar.n = done
            if note:
                self.bar.set_postfix_str(note, refresh=False)
            self.bar.refresh()

    def advance(self, n: int = 1) -> None:
        """``n`` more units of work finished."""
        if self.bar is not None:
            self.bar.update(n)

    def replay_callback(self, num_ended: int, sim_time_s: float) -> None:
        """The replay loop's ``progress`` callback: requests ended, simulated time."""
        self.set(num_ended, f"t={sim_time_s:.0f}s")

    def close(self, ok: bool = True) -> None:
        """End the phase: fill and close the bar, or log its line (only if ``ok``)."""
        if self.t0 is None:
            return
        elapsed_s, self.t0 = time.perf_counter() - self.t0, None
        if self.bar is not None:
            if ok and self.total is not None:
                self.bar.n = self.total
                self.bar.refresh()
            self.bar.close()
        elif ok:
            log.info("%s in %s", self.name, seconds_text(elapsed_s))

    def __enter__(self) -> Phase:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(ok=exc_type is None)
