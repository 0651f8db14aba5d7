"""Stopping a run cleanly on SIGTERM or SLURM's warning signal (submitit's USR2), so that it can be requeued.

A scheduler that preempts a job, or whose time limit is near, signals it before killing it. Inside
:func:`stop_on_signals` such a signal raises :class:`Stopped` in the main thread at the next bytecode: the
question in flight is abandoned (nothing of it is written), files are closed by the ``finally`` blocks on the
way out, and the rerun (or the requeued job) resumes after the last complete record. The one thing that must
never be cut half-way, a question's record and the hot-start state saved with it, runs inside
:func:`critical`: a signal that arrives there is held until both are written, then raised.

After a stop, a Python handler that was installed before ours (submitit's ``checkpoint_and_try_requeue``
on USR2) is called, so the launcher's own requeue runs once the files are closed.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
# The exit status of a run stopped by one of STOP_SIGNALS: EX_TEMPFAIL, "try again later" (rerunning resumes).
EXIT_STOPPED = 75


class Stopped(BaseException):
    """A stop signal arrived. A BaseException, so that no ``except Exception`` (a question's error record)
    swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.where = ""  # filled in on the way out: the file and the question it stopped at

    def locate(self, path: Path, question: object, recorded: bool, done: int, total: int) -> None:
        """Say where the run stopped (the innermost caller that knows says it first)."""
        if not self.where:
            state = "after question {} (recorded)" if recorded else "in question {} (abandoned, nothing of it written)"
            self.where = f"{state.format(question)} of {path}; {done} of {total} questions recorded"

    def message(self) -> str:
        where = self.where or "while starting (before its first answer of this start)"
        return f"draftbench: stopped by {self.args[0]} {where}; rerun the same command to resume"


_held: list[int] = []  # a signal that arrived inside critical(), raised when it ends
_depth = 0


def _handler(signum: int, frame: object) -> None:
    if _depth:
        _held.append(signum)
    else:
        raise Stopped(signum)


@contextmanager
def critical() -> Iterator[None]:
    """Hold a stop signal until the block is done (a record and its hot-start state are written together)."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _held:
            signum = _held[0]
            _held.clear()
            raise Stopped(signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Turn STOP_SIGNALS into :class:`Stopped` inside the block (main thread only: Python delivers signals
    there, and a worker thread cannot install handlers). On a stop, print where it stopped, hand the signal to
    the handler installed before (a launcher's requeue), then let Stopped go on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _handler) for s in STOP_SIGNALS}
    try:
        yield
    except Stopped as stop:
        for s, handler in previous.items():
            signal.signal(s, handler)
        print(stop.message(), file=sys.stderr, flush=True)
        before = previous[stop.signum]
        if callable(before):  # e.g. submitit's: checkpoint and requeue, then exit
            before(stop.signum, None)
        raise
    finally:
        _held.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)
