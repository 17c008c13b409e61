"""The solve kernels' C sources: warning-free, and called with the signatures they declare."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gridsolve.stages.solve import kernel

HEADER = kernel.CSRC / "gs_kernels.h"

#: C parameter and return types → the ctypes type that passes them (pointers: c_void_p).
CTYPES: dict[str, Any] = {
    "long": ctypes.c_long,
    "int": ctypes.c_int,
    "double": ctypes.c_double,
    "signed char": ctypes.c_byte,
    "void": None,
}


def declarations() -> dict[str, tuple[Any, list[Any]]]:
    """Function name → (return ctypes type, parameter ctypes types), from gs_kernels.h."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    found: dict[str, tuple[Any, list[Any]]] = {}
    for ret, name, params in re.findall(r"\b(int|void)\s+(gs_\w+)\s*\(([^)]*)\)\s*;", text):
        types = []
        for p in " ".join(params.split()).split(","):
            p = p.strip().removeprefix("const ")
            if "*" in p:
                types.append(ctypes.c_void_p)
            else:
                types.append(CTYPES[p.rsplit(" ", 1)[0]])
        found[name] = (CTYPES[ret], types)
    return found


class _Recorder:
    """Stands for the loaded library: records the argtypes and restype ``_bind`` sets."""

    def __init__(self) -> None:
        self.fns: dict[str, SimpleNamespace] = {}

    def __getattr__(self, name: str) -> SimpleNamespace:
        return self.fns.setdefault(name, SimpleNamespace(argtypes=None, restype=ctypes.c_int))


def test_the_ctypes_signatures_are_the_headers() -> None:
    declared = declarations()
    assert len(declared) >= 12, declared  # the parse found the declarations
    lib = _Recorder()
    kernel._bind(lib)  # type: ignore[arg-type]
    assert set(lib.fns) == set(declared), "bound and declared functions differ"
    for name, (ret, params) in declared.items():
        bound = lib.fns[name]
        assert list(bound.argtypes) == params, name
        assert bound.restype is ret, name


def test_the_header_parse_tells_pointers_from_integers() -> None:
    # the check above compares position by position, so a long bound where a pointer is
    # declared (or the reverse) fails it
    ret, params = declarations()["gs_solve"]
    assert ret is None and params[3] is ctypes.c_void_p and params[0] is ctypes.c_long


@pytest.mark.slow  # a full -O3 build of the library (~35 s here)
def test_the_kernels_compile_without_warnings(tmp_path: Path) -> None:
    cc = kernel._compiler()
    if cc is None:
        pytest.fail("no C compiler (cc or gcc): the kernels cannot be checked")
    strict = ["-Wall", "-Wextra", "-Werror"]
    # as the library is built (clones per instruction set), then without clones (the
    # fallback for compilers without target_clones), the latter checked for syntax only
    for extra, out in ((["-DGS_CLONES"], ["-o", str(tmp_path / "k.so")]), ([], ["-fsyntax-only"])):
        done = subprocess.run(
            [*cc, *kernel.FLAGS, *strict, *extra, str(kernel.MAIN_SOURCE), *out, "-lm"],
            capture_output=True,
            text=True,
            timeout=kernel.BUILD_TIMEOUT_S,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-4000:]
        assert "warning" not in done.stderr, done.stderr[-4000:]
