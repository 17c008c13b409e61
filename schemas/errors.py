"""The one error hierarchy of gridsolve.

Every error a user can meet is a :class:`GridsolveError`. Its message names the
stage, what was expected, what was found and how to fix it; contract errors
carry every violation at once, not only the first. The CLI prints ``str(err)``
without a traceback and exits with :data:`EXIT_CODE`. A :class:`StageError` is
the exception: a bug or a crash, whose traceback the run log keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

EXIT_CODE = 2


class GridsolveError(Exception):
    """Base class: a problem the user can understand and fix."""

    kind = "error"

    def __init__(
        self,
        problem: str,
        *,
        stage: str | None = None,
        expected: str | None = None,
        found: str | None = None,
        fix: str | None = None,
        violations: Sequence[str] = (),
        transient: bool = False,
    ) -> None:
        self.problem = problem
        #: an I/O hiccup that a retry may cure (never bad input or config)
        self.transient = transient
        self.stage = stage
        self.expected = expected
        self.found = found
        self.fix = fix
        self.violations = list(violations)
        super().__init__(self.render())

    def render(self) -> str:
        """The full user-facing message."""
        where = f"[{self.stage}] " if self.stage else ""
        lines = [f"{self.kind}: {where}{self.problem}"]
        lines += [f"  - {v}" for v in self.violations]
        if self.expected is not None:
            lines.append(f"  expected: {self.expected}")
        if self.found is not None:
            lines.append(f"  found:    {self.found}")
        if self.fix is not None:
            lines.append(f"  fix:      {self.fix}")
        return "\n".join(lines)

    def with_stage(self, stage: str) -> GridsolveError:
        """The same error, attributed to ``stage`` (``kind/impl``) when it names none yet.

        An error that names only the kind (``load``) gets the implementation too
        (``load/netcdf``): every message of a stage carries the same label.
        """
        if self.stage is None or stage.split("/", 1)[0] == self.stage:
            self.stage = stage
            self.args = (self.render(),)
        return self

    def __reduce__(self) -> tuple[object, ...]:
        # Errors cross process boundaries (Dask workers, Prefect results):
        # rebuild from the fields, not from the rendered message.
        return (
            _rebuild,
            (
                type(self),
                self.problem,
                self.stage,
                self.expected,
                self.found,
                self.fix,
                tuple(self.violations),
                self.transient,
            ),
        )


def _rebuild(
    cls: type[GridsolveError],
    problem: str,
    stage: str | None,
    expected: str | None,
    found: str | None,
    fix: str | None,
    violations: tuple[str, ...],
    transient: bool = False,
) -> GridsolveError:
    return cls(
        problem,
        stage=stage,
        expected=expected,
        found=found,
        fix=fix,
        violations=violations,
        transient=transient,
    )


def first_line(exc: BaseException) -> str:
    """``exc`` in one line for a log: its type and the first line of its message."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line[:300]}"


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's to fix: shown as its message alone, never a traceback."""
    return isinstance(exc, GridsolveError) and not isinstance(exc, StageError)


def is_transient(exc: BaseException) -> bool:
    """Whether a failure may pass on a retry: transient I/O, or an unexpected non-user error."""
    if isinstance(exc, GridsolveError):
        return exc.transient
    return isinstance(exc, OSError)


class ConfigError(GridsolveError):
    """The configuration is invalid (unknown key, bad value, unknown impl)."""

    kind = "config error"


class InputError(GridsolveError):
    """An input file is missing, unreadable, corrupt or not NetCDF."""

    kind = "input error"


class ContractError(GridsolveError):
    """Data does not meet a stage's contract (dims, dtypes, shapes, values)."""

    kind = "contract error"


class NumericalError(GridsolveError):
    """A computation would be meaningless (singular system, float32 too coarse)."""

    kind = "numerical error"


class OutputError(GridsolveError):
    """The output cannot be written (unwritable folder, disk full, outside root)."""

    kind = "output error"


class StageError(GridsolveError):
    """A stage failed for a reason that is not the user's input (a bug or a crash)."""

    kind = "stage error"


class StoreError(GridsolveError):
    """The artifact store cannot be used (unwritable, corrupt beyond recovery)."""

    kind = "store error"
