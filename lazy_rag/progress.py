"""Progress of long work (index builds, evaluations): a bar on a terminal, plain lines elsewhere.

A run on a GPU machine or in CI writes to a log file, where a live bar prints nothing useful:
there, a line goes out every ``every_s`` seconds or every ``every_fraction`` of the work, with
done/total, elapsed time, the remaining time at the current rate, and a note from the caller
(the running F1 of ``full``).
"""
from __future__ import annotations

import sys
import time

STYLES = ("auto", "bar", "lines", "none")


def check_style(style: str) -> str:
    """``style``, if it is one of ``STYLES``; else a ValueError naming the choices (callers check it
    before long work starts: a model load takes a minute)."""
    if style not in STYLES:
        raise ValueError(f"{style!r} is not a progress style; choose one of {', '.join(STYLES)}.")
    return style


def _clock_text(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def resolved_style(style: str, stream=None) -> str:
    """``style`` with auto resolved: a bar on a terminal, plain lines anywhere else."""
    if style == "auto":
        return "bar" if getattr(stream or sys.stderr, "isatty", lambda: False)() else "lines"
    return style


class Progress:
    def __init__(self, total: int, label: str, style: str = "auto", stream=None, every_s: float = 30.0,
                 every_fraction: float = 0.05, clock=time.monotonic):
        check_style(style)
        self.stream = stream or sys.stderr
        style = resolved_style(style, self.stream)
        self.style, self.total, self.label = style, max(int(total), 1), label
        self.every_s, self.every_fraction, self.clock = every_s, every_fraction, clock
        self.done, self.note = 0, ""
        self.start = self.last_line = clock()
        self.next_fraction = every_fraction
        self._bar = None
        if style == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeRemainingColumn

            self._bar = Bar(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[note]}"), console=Console(file=self.stream))
            self._bar.start()
            self._task = self._bar.add_task(label, total=self.total, note="")

    def say(self, message: str) -> None:
        """A message that is not progress (which index is used, what is skipped), in every style but none."""
        if self._bar is not None:
            self._bar.console.print(message, markup=False, highlight=False)
        elif self.style == "lines":
            print(message, file=self.stream, flush=True)

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self.note = note
        if self._bar is not None:
            self._bar.update(self._task, advance=n, note=self.note)
        elif self.style == "lines":
            now = self.clock()
            fraction = self.done / self.total
            if now - self.last_line >= self.every_s or fraction >= self.next_fraction or self.done >= self.total:
                self._line(now)
                self.last_line = now
                while self.next_fraction <= fraction:
                    self.next_fraction += self.every_fraction

    def _line(self, now: float) -> None:
        elapsed = now - self.start
        eta = elapsed / self.done * (self.total - self.done) if self.done else float("nan")
        text = (f"[{self.label}] {self.done}/{self.total} ({100 * self.done / self.total:.0f}%), elapsed "
                f"{_clock_text(elapsed)}, ETA {_clock_text(eta) if self.done else '?'}")
        print(text + (f"; {self.note}" if self.note else ""), file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
