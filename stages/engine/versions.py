"""What computed a result: the source of the code that ran and the library versions.

Cache keys and the output's ``gridsolve_versions`` attribute both come from
here, so an output names the versions that computed it and no cache entry
survives a change of code or of a library that can change numbers.

Code is versioned the way Hamilton versions functions: by a digest of its
source with comments and docstrings removed (the ``ast`` of each module,
without line numbers), over the module that defines an implementation and
every module it imports at module level, transitively, that is gridsolve's
own (``gridsolve.*``), of the same top-level package as the
implementation, or local (a ``.py`` file outside the standard library and
site-packages: a user's package). Imports inside functions are not followed:
in gridsolve they only register implementations or break import cycles, and
following them would make every stage depend on every other. Packages
installed in site-packages are covered by their version instead, for those
that can change numbers (:data:`NUMERIC_PACKAGES`). Code that is not Python
(the solve's C kernels) is covered through the module that builds it, which
names its files in a module-level ``CODE_FILES`` tuple.

The digest is of the files on disk, re-read when their size or mtime change;
a long-running process (a Dask worker) whose files were edited under it runs
its old code, so restart workers after changing code. Parsed files are also
remembered on disk by their content (:func:`memo_file`), so a new process
reads each module but does not parse it again.
"""

from __future__ import annotations

import ast
import functools
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import json
import os
import site
import sys
import sysconfig
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from gridsolve.schemas.errors import ConfigError
from gridsolve.stages.engine.hashing import canonical_json, hash_text
from gridsolve.stages.engine.pyparse import PARSE_LOCK

#: Distributions whose version can change the numbers (or bytes) gridsolve
#: produces. h5py: the NetCDF writer stores its compressed chunks through it, and
#: isal deflates them (stages/write/direct.py; absent, zlib does: "unknown").
#: Prefect only orchestrates.
NUMERIC_PACKAGES = (
    "gridsolve",
    "numpy",
    "scipy",
    "torch",
    "xarray",
    "netCDF4",
    "h5py",
    "isal",
)

#: gridsolve's own top-level package: always versioned by source, wherever installed.
GRIDSOLVE_PACKAGES = frozenset({"gridsolve"})


# ---------------------------------------------------------------- libraries
@functools.cache
def _installed_versions() -> tuple[tuple[str, str], ...]:
    out = [("python", sys.version.split()[0])]
    for pkg in NUMERIC_PACKAGES:
        try:
            out.append((pkg, importlib.metadata.version(pkg)))
        except importlib.metadata.PackageNotFoundError:
            out.append((pkg, "unknown"))
    return tuple(out)


def package_versions() -> dict[str, str]:
    """Versions of Python and of the packages that can change numbers (read once per process).

    Part of every cache key, and recorded in every output as ``gridsolve_versions``.
    """
    return dict(_installed_versions())


def forget_versions() -> None:
    """Read the installed versions again on next use (tests that fake a version)."""
    _installed_versions.cache_clear()


# ---------------------------------------------------------------- code
@dataclass(frozen=True)
class _Parsed:
    digest: str
    imports: tuple[str, ...]
    #: files beside the module that are code it runs (its ``CODE_FILES``: C sources)
    files: tuple[str, ...] = ()


_PARSED: dict[tuple[str, int, int, int], _Parsed] = {}
_LOCK = threading.Lock()
#: the memo file's entries read in this process (None: not read yet), the keys this
#: process used, and whether it added any
_DISK: dict[str, list[Any]] | None = None
_USED: set[str] = set()
_DISK_NEW = False
#: entries kept at most; beyond that only those this process used are written back
MEMO_MAX_ENTRIES = 4000


@functools.cache
def memo_file() -> Path | None:
    """Where parsed digests are remembered between processes; None: nowhere (no home).

    One file per Python version (``ast`` output differs between versions) and per
    version of this module (the digest's definition), under ``$XDG_CACHE_HOME``
    or ``~/.cache``. Entries are keyed by the source's content, so an edit can
    never meet a stale entry; deleting the file only costs the next run a parse.
    """
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            return None
        base = os.path.join(home, ".cache")
    v = sys.version_info
    this = xxhash.xxh3_64_hexdigest(Path(__file__).read_bytes())
    return Path(base) / "gridsolve" / f"code-digests-py{v[0]}{v[1]}-{this}.json"


def _valid_entry(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) == 3
        and isinstance(value[0], str)
        and all(isinstance(v, list) and all(isinstance(i, str) for i in v) for v in value[1:])
    )


def _disk() -> dict[str, list[Any]]:
    global _DISK
    if _DISK is None:
        _DISK = {}
        path = memo_file()
        try:
            loaded = json.loads(path.read_text()) if path is not None else {}
        except (OSError, ValueError):
            loaded = {}
        if isinstance(loaded, dict):
            _DISK = {k: v for k, v in loaded.items() if _valid_entry(v)}
    return _DISK


def save_memo() -> None:
    """Write this process's new digests to :func:`memo_file` (atomically; best effort)."""
    global _DISK, _DISK_NEW
    with _LOCK:
        if not _DISK_NEW or _DISK is None:
            return
        _DISK_NEW = False  # once: a read-only home is not retried on every digest
        path = memo_file()
        if path is None:
            return
        if len(_DISK) > MEMO_MAX_ENTRIES:
            _DISK = {k: v for k, v in _DISK.items() if k in _USED}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
            tmp.write_text(json.dumps(_DISK))
            os.replace(tmp, path)  # concurrent writers: the last one's memo is kept, whole
        except (OSError, ValueError, TypeError):
            return  # digests are computed again next time


class _StripDocstrings(ast.NodeTransformer):
    """Drops the docstring of every module, class and function (they never change results)."""

    def _strip(self, node: ast.AST) -> ast.AST:
        self.generic_visit(node)
        body = getattr(node, "body", None)
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]  # type: ignore[attr-defined]
        return node

    visit_Module = _strip
    visit_ClassDef = _strip
    visit_FunctionDef = _strip
    visit_AsyncFunctionDef = _strip


def _module_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run when the module is imported: not those inside functions or classes."""
    for node in body:
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        for name in ("body", "orelse", "finalbody"):
            yield from _module_level(getattr(node, name, []) or [])
        for handler in getattr(node, "handlers", []) or []:
            yield from _module_level(handler.body)


def _imports(tree: ast.Module, package: str) -> tuple[str, ...]:
    """Absolute names of what ``tree`` imports at module level (``from a import b``: a.b and a)."""
    names: list[str] = []
    for node in _module_level(tree.body):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                try:
                    base = importlib.util.resolve_name("." * node.level + base, package)
                except ImportError:
                    continue
            # ``from a import b`` runs a's __init__ only when b is not a submodule of a;
            # which it is gets decided when the names are resolved to files.
            names.append(f"{base}:" + ",".join(alias.name for alias in node.names))
    return tuple(names)


def _code_files(tree: ast.Module) -> tuple[str, ...]:
    """The module's ``CODE_FILES``: paths, relative to its folder, of other code it runs.

    A module that compiles or loads code that is not Python (the solve's C kernels)
    names those files in a module-level tuple of strings, so that the digest covers them.
    """
    for node in tree.body:
        if (
            isinstance(node, ast.Assign | ast.AnnAssign)
            and any(
                isinstance(t, ast.Name) and t.id == "CODE_FILES"
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            )
            and isinstance(node.value, ast.Tuple)
        ):
            return tuple(
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            )
    return ()


def _parse(path: str, package: str) -> _Parsed:
    global _DISK_NEW
    st = os.stat(path)
    memo = (path, st.st_size, st.st_mtime_ns, st.st_ino)
    with _LOCK:
        if memo in _PARSED:
            return _PARSED[memo]
    source = Path(path).read_bytes()
    # Across processes by content (relative imports resolve against the package).
    disk_key = f"{package}|{xxhash.xxh3_128_hexdigest(source)}"
    with _LOCK:
        known = _disk().get(disk_key)
        if known is not None:
            _USED.add(disk_key)
            _PARSED[memo] = _Parsed(known[0], tuple(known[1]), tuple(known[2]))
            return _PARSED[memo]
    try:
        with PARSE_LOCK:
            tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):
        parsed = _Parsed(digest=hash_text(source.decode("utf-8", "replace")), imports=())
    else:
        imports = _imports(tree, package)
        files = _code_files(tree)
        normalised = ast.dump(_StripDocstrings().visit(tree), include_attributes=False)
        parsed = _Parsed(digest=hash_text(normalised), imports=imports, files=files)
    with _LOCK:
        _PARSED[memo] = parsed
        _disk()[disk_key] = [parsed.digest, list(parsed.imports), list(parsed.files)]
        _USED.add(disk_key)
        _DISK_NEW = True
    return parsed


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    dirs = {
        sysconfig.get_paths().get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")
    }
    dirs.update(site.getsitepackages())
    dirs.add(site.getusersitepackages())
    return tuple(os.path.realpath(d) for d in dirs if d)


def _is_library(path: str) -> bool:
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + os.sep) for d in _library_dirs())


def _source_file(name: str) -> str | None:
    """The ``.py`` file of module ``name`` (without importing it), or None."""
    if name.partition(".")[0] in GRIDSOLVE_PACKAGES:
        return _own_source_file(name)
    return _find_source_file(name)


@functools.cache
def _own_source_file(name: str) -> str | None:
    # gridsolve's own modules stay where they are for the life of a process; its stages
    # import most of them lazily, so each is otherwise searched for once per stage key
    return _find_source_file(name)


def _find_source_file(name: str) -> str | None:
    mod = sys.modules.get(name)
    if mod is not None:
        f = getattr(mod, "__file__", None)
        return f if isinstance(f, str) and f.endswith(".py") else None
    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if not rest:
        return spec.origin if spec.origin and spec.origin.endswith(".py") else None
    dirs = list(spec.submodule_search_locations or [])
    *packages, last = rest.split(".")
    for part in packages:
        dirs = [str(Path(d) / part) for d in dirs if (Path(d) / part).is_dir()]
    for d in dirs:
        for candidate in (Path(d) / f"{last}.py", Path(d) / last / "__init__.py"):
            if candidate.is_file():
                return str(candidate)
    return None


@functools.cache
def _library_package(top: str) -> bool:
    """Whether the top-level package ``top`` lies in a library folder (nothing imported).

    Its modules are never tracked unless it is a root's package, so they are not
    looked up one by one: a run whose stages are all cache hits has not imported
    torch or xarray, and finding each of their modules' files costs a search.
    """
    mod = sys.modules.get(top)
    origin = getattr(mod, "__file__", None) if mod is not None else None
    if not isinstance(origin, str):
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            return False
        if spec is None:
            return False
        if spec.origin is None:  # a namespace package: a library only if every portion is
            portions = list(spec.submodule_search_locations or [])
            return bool(portions) and all(_is_library(p) for p in portions)
        origin = spec.origin
    return isinstance(origin, str) and _is_library(origin)


def _tracked(name: str, path: str, tops: frozenset[str]) -> bool:
    top = name.partition(".")[0]
    return top in GRIDSOLVE_PACKAGES or top in tops or not _is_library(path)


def _package_of(name: str, path: str) -> str:
    return name if path.endswith("__init__.py") else name.rpartition(".")[0]


def module_digests(roots: Iterable[str]) -> dict[str, str]:
    """Digest of the normalised source of each module ``roots`` run, by module name.

    The roots themselves, and what they import at module level, transitively,
    that is gridsolve's own, of a root's top-level package, or local.
    """
    roots = sorted(set(roots))
    tops = frozenset(r.partition(".")[0] for r in roots)
    out: dict[str, str] = {}
    todo = list(roots)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        top = name.partition(":")[0].partition(".")[0]
        outside = name not in roots and top not in GRIDSOLVE_PACKAGES and top not in tops
        if outside and _library_package(top):
            continue  # as _tracked would decide for each of its modules
        if ":" in name:  # ``from base import a, b``
            base, _, listed = name.partition(":")
            subs = [f"{base}.{a}" for a in listed.split(",") if a != "*"]
            found = [s for s in subs if _source_file(s) is not None]
            todo += found
            if len(found) < len(subs) or not subs:
                todo.append(base)  # names from base's own namespace: its __init__ runs
            continue
        path = _source_file(name)
        if path is None:
            if name in roots:
                out[name] = "no source"
            continue
        if name not in roots and not _tracked(name, path, tops):
            continue
        parsed = _parse(path, _package_of(name, path))
        out[name] = parsed.digest
        for f in parsed.files:
            try:
                out[f"{name}/{f}"] = xxhash.xxh3_128_hexdigest((Path(path).parent / f).read_bytes())
            except OSError:
                out[f"{name}/{f}"] = "missing"
        todo += parsed.imports
    return dict(sorted(out.items()))


def code_digest(roots: Iterable[str]) -> str:
    """One digest of the source of the modules ``roots`` run (see :func:`module_digests`)."""
    digest = hash_text(canonical_json(module_digests(roots)))
    save_memo()
    return digest


#: what identifies one import of a module (see :func:`_import_of`)
_Import = tuple[Callable[[], object], Callable[[], object]]
#: module name → (the module object and its import spec, digest of its source) when
#: this process last keyed it as imported afresh: the code it runs, whatever the file
#: holds now. Weak references, not ids: a module dropped from sys.modules and imported
#: afresh may be given its predecessor's id, and would then be taken for the old one.
_IMPORTED: dict[str, tuple[_Import, str]] = {}
_IMPORTED_LOCK = threading.Lock()


def _ref(obj: object) -> Callable[[], object]:
    """A weak reference to ``obj`` where it allows one, else a strong one."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _import_of(loaded: object) -> _Import:
    """What identifies one import of the module ``loaded``: the object and its spec."""
    return _ref(loaded), _ref(getattr(loaded, "__spec__", None))


def _same_import(seen: _Import, loaded: object) -> bool:
    """Whether ``loaded`` is the module object, from the same import, that ``seen`` recorded.

    ``importlib.reload`` keeps the module object but gives it a fresh spec (before it
    runs the module: a reload that raised counts as one that ran).
    """
    return seen[0]() is loaded and seen[1]() is getattr(loaded, "__spec__", None)


def user_code_digest(obj: object, target: str) -> str:
    """Digest of the source a user's class or function runs: its module and local imports.

    Defined where there is no source file (an interactive session): its own source,
    or failing that its import path. Raises ConfigError when the process may run other
    code than the files hold (a notebook's kernel, ``gridsolve serve``): a module it
    has imported was edited since it was keyed here, or a local import was imported
    again (reloaded) after the edit while the target's module was not, so that the
    target may still call the old code (``from helper import g``).
    """
    module = str(getattr(obj, "__module__", target.partition(":")[0]))
    digests = module_digests([module])
    if digests.get(module, "no source") == "no source":
        try:
            digests[module] = hash_text(inspect.getsource(obj))  # type: ignore[arg-type]
        except (OSError, TypeError):
            digests[module] = hash_text(target)
    with _IMPORTED_LOCK:
        fresh: dict[str, object] = {}
        edited, stale = [], []
        for name, digest in digests.items():
            loaded = sys.modules.get(name)
            if loaded is None:
                continue  # imported afresh when the stage runs: it runs what the file holds
            seen = _IMPORTED.get(name)
            if seen is None or not _same_import(seen[0], loaded):
                fresh[name] = loaded  # first keyed, or imported again: the file's code runs
                if seen is not None and seen[1] != digest:
                    stale.append(name)
            elif seen[1] != digest:
                edited.append(name)
        if module not in sys.modules or (module in fresh and module in _IMPORTED):
            # the target's module is imported afresh, or was imported again since it was
            # keyed: it imports the modules as they are now (one never keyed before may
            # have been imported before the edit: still refused)
            stale = []
        if not edited and not stale:
            for name, obj_ in fresh.items():
                _IMPORTED[name] = (_import_of(obj_), digests[name])
    if edited:
        raise ConfigError(
            f"the source of {', '.join(sorted(edited))} changed after this process imported it",
            found=f"{target}: the file on disk differs from the code this process runs",
            fix="restart the process (a notebook's kernel, gridsolve serve), or importlib.reload "
            f"the edited modules and then {module}, so that the run runs the code its cache "
            "key covers",
        )
    if stale:
        raise ConfigError(
            f"{', '.join(sorted(stale))} was imported again after an edit, {module} was not: "
            "it may still run the code from before the edit",
            found=f"{target}: {module} was imported before the edit",
            fix=f"importlib.reload {module} too (or restart the process), so that the run runs "
            "the code its cache key covers",
        )
    return hash_text(canonical_json(digests))
