"""Stopping a command by signal: SIGINT (Ctrl-C), SIGTERM and SIGHUP (a closed terminal) all
stop a run as Ctrl-C does, raised where the program was so that its cleanup runs (temporary
folders removed, workers ended, completed runs kept). Used by ``sched-lab run`` (lab/cli.py)
and ``sched-lab bench`` (lab/client/bench.py)."""

from __future__ import annotations

import signal
import threading

STOP_SIGNALS = tuple(
    getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n)
)


class Interrupted(KeyboardInterrupt):
    """One of :data:`STOP_SIGNALS`, raised where the program was. Its only argument is the
    signal number, ``signum`` (SimPy re-creates an exception from its arguments)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


def stop_name(e: KeyboardInterrupt) -> str:
    """The name of the signal that stopped a command (SIGINT for a plain Ctrl-C)."""
    return signal.Signals(getattr(e, "signum", signal.SIGINT)).name


def stop_code(e: KeyboardInterrupt) -> int:
    """The exit status of a command stopped by ``e``'s signal: 128 + its number."""
    return 128 + getattr(e, "signum", signal.SIGINT)


class StopSignals:
    """While active (entered in the main thread), :data:`STOP_SIGNALS` raise
    :class:`Interrupted`; while ``deferring``, the first is only recorded in ``pending`` and a
    second raises; while ``closing`` (the last cleanup of a command that already ends), none
    raises (the first is recorded). An ignored signal stays ignored; the handlers before are
    put back on exit."""

    def __init__(self) -> None:
        self.deferring = self.closing = False
        self.pending: int | None = None
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if (self.deferring or self.closing) and self.pending is None:
            self.pending = signum
            return
        if not self.closing:
            raise Interrupted(signum)

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
