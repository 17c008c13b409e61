"""Where a run's time goes: the phases of each stage, and the marks of the run around them.

Two small records, neither of which knows Prefect:

* a :class:`Clock` per stage part (a whole stage, a prepare step, a tile): the runner
  runs each phase of the part inside ``clock.phase(name)`` — ``key`` (the cache key,
  hashing the input files included), ``lookup`` (the store's index), ``setup``
  (importing the implementation), ``open`` (the stored inputs), ``read`` / ``compute``
  / ``write`` (the function: ``read`` for the stage that reads the cube, ``write`` for
  the writers), ``check`` (the contract) and ``store``. Stage code marks work of
  another kind inside its function with :func:`part` (``setup`` for loading a
  compiled kernel or compiling, ``read`` for reading blocks of the cube): that time
  counts there and not in the enclosing phase, so the phases of a part add up to its
  time.
* the process's :data:`MARKS`: named instants of the run (the process start, the
  flow's start and end, …) from which ``gridsolve run --profile`` reports the time
  spent outside the stages.

Timing never changes a result or a key.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar

#: The phases of a stage part, in the order they run and are shown.
PHASES = ("key", "lookup", "setup", "open", "read", "compute", "write", "check", "store")


class Clock:
    """Seconds per phase of one stage part; a nested phase's time counts in it alone.

    A clock belongs to the thread that runs its part: :func:`part` in a thread the
    stage started finds no clock and counts nothing.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._stack: list[list[float]] = []  # [start, seconds of nested phases]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the time inside the block as phase ``name`` (less that of nested phases)."""
        frame = [time.perf_counter(), 0.0]
        self._stack.append(frame)
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)
            self._stack.pop()
            spent = time.perf_counter() - frame[0]
            self.seconds[name] = self.seconds.get(name, 0.0) + spent - frame[1]
            if self._stack:
                self._stack[-1][1] += spent

    def rounded(self) -> dict[str, float]:
        """The phases with any time, in :data:`PHASES` order, rounded to 0.1 ms."""
        return {n: round(s, 4) for n, s in ordered(self.seconds).items() if s >= 5e-5}


def ordered(phases: Mapping[str, float]) -> dict[str, float]:
    """``phases`` in :data:`PHASES` order (others after them, by name)."""
    order = {p: i for i, p in enumerate(PHASES)}
    return {n: phases[n] for n in sorted(phases, key=lambda n: (order.get(n, len(order)), n))}


_CURRENT: ContextVar[Clock | None] = ContextVar("gridsolve_clock", default=None)


def part(name: str) -> contextlib.AbstractContextManager[None]:
    """In stage code: count the block as phase ``name`` of the running stage part.

    Outside a part the runner times (or in a thread the stage started), a no-op.
    """
    clock = _CURRENT.get()
    return clock.phase(name) if clock is not None else contextlib.nullcontext()


def add(into: dict[str, float], phases: dict[str, float]) -> None:
    """Add ``phases`` to ``into``, phase by phase."""
    for name, seconds in phases.items():
        into[name] = into.get(name, 0.0) + seconds


# ---------------------------------------------------------------- the run's marks
#: Named instants of this process's latest run, as ``time.time()``.
MARKS: dict[str, float] = {}


def mark(name: str) -> None:
    """Note that the run reached ``name`` now."""
    MARKS[name] = time.time()


def process_start() -> float | None:
    """When this process started (``time.time()`` scale), from /proc; None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        # the command name may hold spaces: fields after the last ')'
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])  # seconds since boot, to 10 ms
        return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def torch_func_ready() -> None:
    """Import what torch.func's first call imports (``torch._dynamo``, about 1 s), as setup.

    ``vmap`` and ``grad`` import it on first use: without this their first call would count
    an import as the stage's compute.
    """
    with part("setup"):
        import torch._dynamo  # noqa: F401
