"""Progress output for long work: a rich progress bar on rank 0 when a person watches a terminal, plain periodic
lines otherwise (a log file, a pipe, a batch scheduler), nothing on the other ranks.

    with StepProgress(total=steps, description="train", enabled=fabric.is_global_zero) as bar:
        for step in ...:
            bar.update(loss=loss_value)            # one step done; fields shown next to the bar
            bar.print("step 10  held-out loss 2.3")  # a line above the bar (or a plain line)

Trainer: ``trainer_progress_callbacks()`` gives Lightning's ``RichProgressBar`` in a terminal and
``PlainProgress`` (periodic lines) elsewhere; pass ``enable_progress_bar=True`` with either.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, TextIO

from lightning.pytorch.callbacks import Callback, ProgressBar, RichProgressBar
from typing_extensions import override

# Set by batch schedulers and job runners: their logs are files, where a redrawn bar becomes thousands of lines.
SCHEDULER_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "KUBERNETES_SERVICE_HOST", "AIRFLOW_CTX_DAG_ID")


def interactive(stream: TextIO | None = None) -> bool:
    """True when ``stream`` (default stdout) is a terminal and no batch scheduler runs this process."""
    stream = sys.stdout if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced streams
        tty = False
    return tty and os.environ.get("TERM") != "dumb" and not any(os.environ.get(v) for v in SCHEDULER_VARIABLES)


def plain_every(total: int | None, lines: int = 10) -> int:
    """Steps between plain progress lines: about ``lines`` lines over the whole run."""
    return max(1, (total or 0) // lines) if total else 50


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class StepProgress:
    """Progress over ``total`` steps. ``enabled=False`` (the other ranks) prints nothing; ``bar=None`` decides by
    :func:`interactive`. Plain mode prints ``description step/total (pct) k=v ... rate eta`` every
    ``every`` steps (default: about ten lines per run) and at the last step."""

    def __init__(self, total: int | None, description: str = "train", enabled: bool = True, bar: bool | None = None,
                 every: int | None = None, unit: str = "steps", start: int = 0) -> None:
        self.total, self.description, self.enabled, self.unit = total, description, enabled, unit
        self.bar = interactive() if bar is None else bar
        self.every = every or plain_every(total)
        self.completed = start
        self._start_completed = start
        self._progress: Any = None
        self._task: Any = None
        self._t0 = time.perf_counter()

    def __enter__(self) -> StepProgress:
        self._t0 = time.perf_counter()
        if self.enabled and self.bar:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
                TimeRemainingColumn

            self._progress = Progress(TextColumn(f"[bold]{self.description}"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                      console=Console(), transient=False)
            self._progress.__enter__()
            self._task = self._progress.add_task(self.description, total=self.total, completed=self.completed,
                                                 info="")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)
            self._progress = None

    def rate(self) -> float:
        elapsed = time.perf_counter() - self._t0
        return (self.completed - self._start_completed) / elapsed if elapsed > 0 else 0.0

    def update(self, advance: int = 1, **fields: Any) -> None:
        """``advance`` steps done; ``fields`` (loss=..., ...) are shown with the bar or on the plain line."""
        self.completed += advance
        if not self.enabled:
            return
        info = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        if self._progress is not None:
            self._progress.update(self._task, advance=advance, info=info)
            return
        if self.completed % self.every == 0 or self.completed == self.total:
            rate = self.rate()
            left = f"  eta {(self.total - self.completed) / rate:.0f}s" if self.total and rate > 0 else ""
            total = f"/{self.total} ({self.completed / self.total:.0%})" if self.total else ""
            print(f"{self.description} {self.completed}{total}  {info}  {rate:.2f} {self.unit}/s{left}".replace(
                "    ", "  "), flush=True)

    def print(self, message: str) -> None:
        """A line of its own (above the bar while one is drawn); rank 0 only."""
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(message, highlight=False, markup=False)
        else:
            print(message, flush=True)


class PlainProgress(ProgressBar):
    """Lightning progress 'bar' for logs: one line every ``every`` training steps on rank 0 with the progress-bar
    metrics (loss, ...), the step rate and the time left; nothing redrawn. ``write``: where a line goes (default:
    printed to stdout), e.g. a logger's ``info``."""

    def __init__(self, every: int | None = None, write: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self.every = every
        self.write = write
        self._enabled = True
        self._t0 = 0.0

    @override
    def disable(self) -> None:
        self._enabled = False

    @override
    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._t0 = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        total = trainer.estimated_stepping_batches
        total = int(total) if total != float("inf") else None
        every = self.every or plain_every(total)
        step = trainer.global_step
        if not (self._enabled and trainer.is_global_zero) or step == 0 or (step % every and step != total):
            return
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        info = "  ".join(f"{k} {_fmt(float(v)) if not isinstance(v, str) else v}" for k, v in metrics.items())
        rate = step / max(time.perf_counter() - self._t0, 1e-9)
        left = f"  eta {(total - step) / rate:.0f}s" if total else ""
        line = f"train {step}{f'/{total}' if total else ''}  {info}  {rate:.2f} steps/s{left}"
        if self.write is not None:
            self.write(line)
        else:
            print(line, flush=True)


def trainer_progress_callbacks(bar: bool | None = None, write: Callable[[str], None] | None = None) -> list[Callback]:
    """The Trainer's progress callback: ``RichProgressBar`` in a terminal, ``PlainProgress`` otherwise (Lightning
    draws its progress bars on rank 0 only); ``write``: where ``PlainProgress`` puts its lines (default: stdout)."""
    return [RichProgressBar() if (interactive() if bar is None else bar) else PlainProgress(write=write)]
