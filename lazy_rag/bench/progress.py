"""Progress over the sweep's points: a rich progress bar when rich is importable (and enabled),
else one plain line per point on stderr (the GPU image has no rich)."""
from __future__ import annotations

import sys
import time


class PlainProgress:
    def __init__(self, total: int, stream=None):
        self.total, self.done, self.stream = total, 0, stream or sys.stderr
        self.t0 = time.perf_counter()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def start(self, description: str) -> None:
        print(f"[{self.done + 1}/{self.total} {time.perf_counter() - self.t0:7.1f} s] {description}",
              file=self.stream, flush=True)

    def advance(self) -> None:
        self.done += 1

    def log(self, message: str) -> None:
        print(message, file=self.stream, flush=True)


class RichProgress:
    def __init__(self, total: int):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), console=Console(stderr=True), transient=False)
        self._task = self._p.add_task("bench", total=total)

    def __enter__(self):
        self._p.__enter__()
        return self

    def __exit__(self, *exc):
        return self._p.__exit__(*exc)

    def start(self, description: str) -> None:
        self._p.update(self._task, description=description)

    def advance(self) -> None:
        self._p.advance(self._task)

    def log(self, message: str) -> None:
        self._p.console.print(message, markup=False, highlight=False)


class SilentProgress(PlainProgress):
    def start(self, description: str) -> None:
        pass

    def log(self, message: str) -> None:
        pass


def make_progress(total: int, mode: str = "auto"):
    """mode: auto (rich on a terminal if importable, else plain), rich, plain, or off."""
    if mode == "off":
        return SilentProgress(total)
    if mode in ("auto", "rich"):
        try:
            import rich  # noqa: F401
        except ImportError:
            return PlainProgress(total)
        if mode == "rich" or sys.stderr.isatty():
            return RichProgress(total)
    return PlainProgress(total)
