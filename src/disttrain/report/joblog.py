"""The log file of a scheduled job: the libraries' warnings and log records go there, once each, with when, which
rank and where from; the console keeps the job's own lines and the problems an operator must act on.

    with job_log(model_root / "logs", verbose=args.verbose) as log:
        try:
            ...                                            # the run: warnings and logging go through the log
        except JobError as e:
            log.error(f"{prog}: error: {e}", exc_info=True)  # stderr on rank 0; the file with the traceback

Where: ``FOLDER/job-YYYY-MM-DD.log`` for a single process or rank 0, ``FOLDER/job-YYYY-MM-DD.rankN.log`` for
rank N under torchrun; YYYY-MM-DD is the UTC day the run started, so the runs of a day share a file, each one
opening with a ``run started`` line and closing with ``run ended``. A line is ``TIME rankN KIND WHERE: MESSAGE``,
e.g. ``2026-11-02T03:00:07Z rank0 FutureWarning torchrec/distributed/model_parallel.py:183: ...``. Each record is
one ``write`` of whole lines to a file opened for appending, so two processes appending to one file (a second run
refused by the first one's lock) cannot interleave partial lines; the ranks write files of their own because a
shared filesystem (NFS) does not keep concurrent appends whole.

What goes where:

- Python warnings, as the warning filters let them through (``-W``, ``PYTHONWARNINGS`` and the code's own
  ``filterwarnings`` still apply): the file, once per category, message and location. Those issued by disttrain's
  own code (a checkpoint loaded without checksums, one restored after an interrupted save) go to stderr too; a
  library's deprecation, future and user warnings stay in the file, also when their ``stacklevel`` points at a line
  of disttrain (the issuer is the code that called ``warnings.warn``).
- ``logging`` records: the file, once per level, logger, message and location; stderr too when they are ERROR or
  worse, or WARNING or worse from disttrain's own loggers (``disttrain.*``). The libraries' console handlers
  (Lightning's "GPU available" lines, torch's ``[rank0]:W...`` lines) are detached for the run so that their
  records reach the file instead, and put back afterwards. disttrain's own INFO records (the training progress
  lines of a run without a terminal) go to the file, every one of them.
- The job's errors (:meth:`JobLog.error`): stderr on rank 0 (the job raises the same error on every rank), the file
  on every rank, with the traceback.
- ``verbose``: every line of the file goes to stderr as well.

When the folder cannot be written, the records go to stderr as they would without the job log (a run must not fail
on its log file).
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import sys
import threading
import time
import traceback
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

# disttrain's own code: what it issues is for the operator (src/disttrain/).
OWN_CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The frames of the warnings machinery between the code that warned and the showwarning hook (the pure-Python
# implementation has Python frames for warn and warn_explicit; the C one has none).
_WARNINGS_MACHINERY = {"_showwarnmsg", "_showwarnmsg_impl", "warn", "warn_explicit"}


def log_path(folder: str | os.PathLike, rank: int = 0, started: Optional[float] = None) -> Path:
    """The file a run started at ``started`` (default: now) writes on ``rank``."""
    day = dt.datetime.fromtimestamp(time.time() if started is None else started, dt.timezone.utc).date()
    return Path(folder) / (f"job-{day.isoformat()}.log" if rank == 0 else f"job-{day.isoformat()}.rank{rank}.log")


def _short(path: str) -> str:
    """A source path as a reader finds it: from the package folder on (``torchrec/distributed/...``)."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if path.startswith(OWN_CODE):
        return "disttrain" + os.sep + path[len(OWN_CODE):]
    return path


def _is_console(stream: Any) -> bool:
    if stream is None:
        return False
    if any(stream is s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)):
        return True
    try:
        return stream.fileno() in (1, 2)
    except (AttributeError, OSError, ValueError):
        return False


def _writes_to_console(handler: logging.Handler) -> bool:
    if isinstance(handler, logging.FileHandler):
        return False
    if isinstance(handler, logging.StreamHandler):
        return _is_console(handler.stream)
    # torch._logging's handler is a plain Handler that writes to whatever sys.stderr is at the time.
    return type(handler).__name__ == "_StderrHandler"


class JobLog:
    """One process's part of a job's log (see the module docstring), appending to ``path`` (None: no file, the
    records go to ``stderr``) as ``rank``; :func:`job_log` makes one and routes warnings and logging to it.
    ``verbose``: every record on ``stderr`` too. Close it with :meth:`close`."""

    def __init__(self, path: Optional[str | os.PathLike], rank: int = 0, verbose: bool = False,
                 stderr: Optional[TextIO] = None) -> None:
        self.path, self.rank, self.verbose = (None if path is None else Path(path)), rank, verbose
        self._stderr = sys.stderr if stderr is None else stderr
        self._fd: Optional[int] = None
        self._seen: set[tuple] = set()
        self._lock = threading.Lock()
        if self.path is not None:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as e:
                self._print(f"cannot write the job log {self.path} ({e.strerror or e}); library warnings go to"
                            " stderr")
                self.path = None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- what the job calls -------------------------------------------------------------------------------------
    def error(self, line: str, exc_info: bool = False) -> None:
        """The job's own error ``line``: stderr on rank 0 (on every rank when there is no file), the file on every
        rank; ``exc_info``: with the traceback of the exception being handled (on stderr only when verbose)."""
        details = traceback.format_exc().rstrip() if exc_info and sys.exc_info()[0] is not None else ""
        if self.rank == 0 or self._fd is None:
            self._print(line + ("\n" + details if details and self.verbose else ""))
        self._write("error", "job", line + ("\n" + details if details else ""), record=False)

    # -- the hooks ----------------------------------------------------------------------------------------------
    def showwarning(self, message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                    line: Optional[str] = None) -> None:
        """``warnings.showwarning`` for the run: once per category, message and location."""
        key = ("warning", category, str(message), filename, lineno)
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
        printed = self._write(category.__name__, f"{_short(filename)}:{lineno}", str(message))
        if not printed and _issuer(sys._getframe(1)).startswith(OWN_CODE):
            self._print(warnings.formatwarning(message, category, filename, lineno, line="").rstrip())

    def handle(self, record: logging.LogRecord) -> None:
        """A ``logging`` record of the run: the file (a library's once per level, logger, message and location)."""
        own = record.name == "disttrain" or record.name.startswith("disttrain.")
        message = record.getMessage()
        if not own:
            key = ("log", record.levelno, record.name, message, record.pathname, record.lineno)
            with self._lock:
                if key in self._seen:
                    return
                self._seen.add(key)
        if record.exc_info:
            message += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        printed = self._write(record.levelname, f"{record.name} {_short(record.pathname)}:{record.lineno}", message)
        if not printed and (record.levelno >= logging.ERROR or (own and record.levelno >= logging.WARNING)):
            self._print(f"{record.levelname} {record.name}: {message}")

    # -- output -------------------------------------------------------------------------------------------------
    def _write(self, kind: str, where: str, message: str, record: bool = True) -> bool:
        """One entry in the file; a ``record`` (a warning, a log record) also on stderr when verbose or when there
        is no file. Returns whether it went to stderr."""
        stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        text = f"{stamp} rank{self.rank} {kind} {where}: " + message.rstrip().replace("\n", "\n    ")
        if self._fd is not None:
            data = (text + "\n").encode("utf-8", "replace")
            try:
                written = os.write(self._fd, data)  # whole lines in one O_APPEND write: never interleaved
                while written < len(data):  # only after a signal or on a full disk
                    written += os.write(self._fd, data[written:])
            except OSError as e:  # a full disk must not stop the run: from here on, stderr
                self.close()
                self._print(f"cannot write the job log {self.path} ({e.strerror}); library warnings go to stderr")
            else:
                if not (record and self.verbose):
                    return False
        if record:
            self._print(text)
        return record

    def _print(self, text: str) -> None:
        try:
            print(text, file=self._stderr, flush=True)
        except (OSError, ValueError):  # a closed stderr (the cron mailer gone) must not stop the run either
            pass


def _issuer(frame: Any) -> str:
    """The file of the code that issued a warning: the first frame above the warnings machinery."""
    machinery = warnings.__file__
    while frame is not None and (frame.f_code.co_filename == __file__ or (
            frame.f_code.co_filename == machinery and frame.f_code.co_name in _WARNINGS_MACHINERY)):
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


class _Handler(logging.Handler):
    def __init__(self, log: JobLog) -> None:
        super().__init__()
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.handle(record)
        except Exception:  # noqa: BLE001  (logging's own rule: a failing handler never raises into the caller)
            self.handleError(record)


@contextmanager
def _logging_routed(log: JobLog) -> Iterator[None]:
    """For the run: the libraries' console handlers detached (their loggers propagate to the root instead), the
    job log's handler on the root logger, disttrain's INFO records let through; all put back afterwards."""
    root, own = logging.getLogger(), logging.getLogger("disttrain")
    saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []
    loggers = [root] + [v for v in list(logging.Logger.manager.loggerDict.values()) if isinstance(v, logging.Logger)]
    for logger in loggers:
        console = [h for h in logger.handlers if _writes_to_console(h)]
        if console:
            saved.append((logger, console, logger.propagate))
            for handler in console:
                logger.removeHandler(handler)
            if logger is not root:
                logger.propagate = True
    handler = _Handler(log)
    root.addHandler(handler)
    own_level = own.level
    if own.getEffectiveLevel() > logging.INFO:
        own.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        own.setLevel(own_level)
        for logger, console, propagate in saved:
            logger.propagate = propagate
            for h in console:
                logger.addHandler(h)


@contextmanager
def job_log(folder: Optional[str | os.PathLike], verbose: bool = False, rank: Optional[int] = None,
            started: Optional[float] = None) -> Iterator[JobLog]:
    """Route the process's warnings and log records through a :class:`JobLog` writing ``log_path(folder, rank,
    started)`` while the block runs (``folder=None``: no file; everything goes to stderr). ``rank``: default the
    launcher's ``RANK`` (0 for a single process); ``started``: the time that names the file's day (default: now)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    t0 = time.time()
    started = t0 if started is None else started
    path = None if folder is None else log_path(folder, rank, started)
    log = JobLog(path, rank, verbose)
    argv = " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else ""
    log._write("run", "started", f"pid {os.getpid()}: {argv}", record=False)
    try:
        with ExitStack() as stack:
            stack.enter_context(warnings.catch_warnings())
            warnings.showwarning = log.showwarning
            stack.enter_context(_logging_routed(log))
            yield log
    except BaseException as e:
        log._write("run", "ended", f"after {time.time() - t0:.1f} s by {type(e).__name__}: {e}", record=False)
        raise
    else:
        log._write("run", "ended", f"after {time.time() - t0:.1f} s", record=False)
    finally:
        log.close()
