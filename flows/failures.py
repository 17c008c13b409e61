"""How a failed run is logged: a user error once, as its message, without a traceback.

Prefect logs a failure several times, each time with the exception's repr and
most with a traceback: the task run's ``Finished in state Failed(…)``, the flow
run's ``Encountered exception during execution`` (traceback), its own
``Finished in state Failed(…)`` and, in a worker's engine subprocess, ``Engine
execution exited with unexpected exception`` (traceback again). For a user
error (see :func:`schemas.errors.is_user_error`) the flow run logs it once, as
``str(error)``; the other records keep their event without the message. The
task and flow run states still carry the full message. Bugs keep Prefect's
records and tracebacks unchanged.

The filter sits on the ``prefect.flow_runs`` and ``prefect.task_runs`` loggers,
not on handlers: Prefect's API log handler hangs on those loggers and handlers
are replaced whenever Prefect configures logging again, logger filters are not.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

from gridsolve.schemas.errors import GridsolveError, is_user_error

FLOW_RUNS = "prefect.flow_runs"
TASK_RUNS = "prefect.task_runs"
#: set on the flow run's one record of a user error (the CLI prints that error itself)
REPORTED = "gridsolve_user_error"
FAILED = "Finished in state Failed"


class _Failures:
    """Runs (flow or task run ids) that failed with a user error: its kind and message."""

    def __init__(self, size: int = 4096) -> None:
        self._errors: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def note(self, run_id: object, exc: GridsolveError) -> bool:
        """Remember that ``run_id`` failed with ``exc``; whether that is news."""
        key, error = str(run_id), (exc.kind, str(exc))
        with self._lock:
            if self._errors.get(key) == error:
                return False
            self._errors[key] = error
            self._errors.move_to_end(key)
            while len(self._errors) > self._size:
                self._errors.popitem(last=False)
            return True

    def forget(self, run_id: object) -> None:
        """``run_id`` failed otherwise (a retry that met another error)."""
        with self._lock:
            self._errors.pop(str(run_id), None)

    def kind(self, run_id: object) -> str | None:
        """The kind of user error ``run_id`` failed with, if it did."""
        with self._lock:
            error = self._errors.get(str(run_id))
        return error[0] if error else None


_FAILED = _Failures()


def _user_error(record: logging.LogRecord) -> GridsolveError | None:
    exc = record.exc_info[1] if record.exc_info else None
    return exc if isinstance(exc, GridsolveError) and is_user_error(exc) else None


class RunLogFilter(logging.Filter):
    """Rewrites Prefect's run records of a user error so that its message is logged once."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to keep ``record`` (rewritten in place where it repeats a user error)."""
        task = record.name.startswith(TASK_RUNS)
        run_id = getattr(record, "task_run_id" if task else "flow_run_id", None)
        exc = _user_error(record)
        if exc is not None:
            news = run_id is None or _FAILED.note(run_id, exc)
            if task or not news:
                return False  # the flow run reports it: every user error ends the flow run
            record.msg, record.args = str(exc), ()
            record.exc_info, record.exc_text = None, None
            setattr(record, REPORTED, True)
            return True
        if isinstance(record.msg, str) and record.msg.startswith(FAILED):
            kind = _FAILED.kind(run_id) if run_id is not None else None
            if kind is not None:
                # Prefect logs str(state): the state's message again, on one escaped line.
                where = ": the flow run reports it" if task else ""
                record.msg, record.args = f"{FAILED} ({kind}{where})", ()
        return True


class ConsoleFilter(logging.Filter):
    """For console handlers: no traceback for a user error; optionally not the error at all."""

    def __init__(self, drop_reported: bool = False) -> None:
        super().__init__()
        self.drop_reported = drop_reported

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether to print ``record`` (without a user error's traceback)."""
        if self.drop_reported and getattr(record, REPORTED, False):
            return False
        if _user_error(record) is not None:
            record.exc_info, record.exc_text = None, None
        return True


def install(cli: bool = False) -> None:
    """Log user errors of flow and task runs once, without tracebacks (idempotent).

    With ``cli``, console handlers also leave out the flow run's report of a user
    error, since the command line prints that error itself.
    """
    for name in (FLOW_RUNS, TASK_RUNS):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RunLogFilter) for f in logger.filters):
            logger.addFilter(RunLogFilter())
    for name in ("prefect", ""):
        for handler in logging.getLogger(name).handlers:
            mine = [f for f in handler.filters if isinstance(f, ConsoleFilter)]
            if not mine:
                handler.addFilter(ConsoleFilter(drop_reported=cli))
            elif cli:
                for f in mine:
                    f.drop_reported = True


@contextmanager
def noting_user_errors() -> Iterator[None]:
    """Inside a task: remember a user error it raises, so its run log leaves the message out."""
    try:
        yield
    except Exception as exc:
        from prefect.context import TaskRunContext

        ctx = TaskRunContext.get()
        if ctx is not None:
            if isinstance(exc, GridsolveError) and is_user_error(exc):
                _FAILED.note(ctx.task_run.id, exc)
            else:
                _FAILED.forget(ctx.task_run.id)
        raise
