"""Every bad input users can meet: one clear message, exit status 2, nothing under the output name.

Each case runs the real `gridsolve run` entry point (in-process, against the
session's Prefect server) on a real file; docs/failures.md lists the same messages.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import save_file

from gridsolve.flows.cli import main
from gridsolve.schemas import errors

from testkit import make_ds

pytestmark = pytest.mark.usefixtures("prefect_server")

Setup = Callable[[Path, dict[str, Any]], None]
KINDS = tuple(
    f"{cls.kind}: "
    for cls in vars(errors).values()
    if isinstance(cls, type)
    and cls.__module__ == errors.__name__
    and issubclass(cls, errors.GridsolveError)
)


def base(tmp_path: Path) -> dict[str, Any]:
    cube = tmp_path / "cube.nc"
    make_ds(n_obs=12, ny=4, nx=5).to_netcdf(cube)
    return {
        "load": {"path": str(cube)},
        "design": {"impl": "polynomial", "degree": 3},
        "model": {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 2},
        "write": {"path": str(tmp_path / "out" / "result.nc")},
        "cache": {"root": str(tmp_path / "cache")},
    }


def cube_with(tmp_path: Path, cfg: dict[str, Any], edit: Callable[[Any], Any], **load: Any) -> None:
    ds = edit(make_ds(n_obs=12, ny=4, nx=5))
    path = tmp_path / "edited.nc"
    ds.to_netcdf(path)
    cfg["load"] = {"path": str(path), **load}


def _missing(t: Path, c: dict[str, Any]) -> None:
    c["load"]["path"] = str(t / "nowhere.nc")


def _not_netcdf(t: Path, c: dict[str, Any]) -> None:
    (t / "table.nc").write_text("time,value\n1,2\n")
    c["load"]["path"] = str(t / "table.nc")


def _truncated(t: Path, c: dict[str, Any]) -> None:
    data = Path(c["load"]["path"]).read_bytes()
    (t / "cut.nc").write_bytes(data[: len(data) // 2])
    c["load"]["path"] = str(t / "cut.nc")


def _design_nan(ds: Any) -> Any:
    A = np.random.default_rng(0).standard_normal((12, 4))
    A[3, 1] = np.nan
    ds["A"] = (("time", "coef"), A)
    return ds


def _nat_time(ds: Any) -> Any:
    time = ds["time"].values.copy()
    time[4] = np.datetime64("NaT")
    return ds.assign_coords(time=time)


def _rank_deficient(ds: Any) -> Any:
    A = np.random.default_rng(0).standard_normal((12, 4))
    A[:, 3] = A[:, 0] - A[:, 2]
    ds["A"] = (("time", "coef"), A)
    return ds


def _checkpoint_shapes(t: Path, c: dict[str, Any]) -> None:
    save_file({"weight": torch.zeros(2, 2, 3), "bias": torch.zeros(3)}, str(t / "w.safetensors"))
    c["model"]["weights"] = str(t / "w.safetensors")


class Payload:
    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, ("open('/tmp/gridsolve-pwned', 'w').write('x')",))


def _pickled_code(t: Path, c: dict[str, Any]) -> None:
    with open(t / "evil.pt", "wb") as f:
        pickle.dump({"weight": Payload()}, f)
    c["model"]["weights"] = str(t / "evil.pt")


CASES: dict[str, tuple[Setup, list[str]]] = {
    "missing file": (_missing, ["input file not found", "check load.path"]),
    "not NetCDF": (_not_netcdf, ["is not NetCDF", "b'time,val'"]),
    "truncated NetCDF": (_truncated, ["corrupt or truncated", "re-create"]),
    "variable absent": (
        lambda t, c: c["load"].update(variable="signl"),
        ["'signl' is not in the file", "Did you mean 'signal'?"],
    ),
    "wrong number of dims": (
        lambda t, c: cube_with(t, c, lambda ds: ds.isel(x=0)),
        ["must have at least 3 dims", "found:    2 dims"],
    ),
    "selection of a dim the cube lacks": (
        lambda t, c: c["load"].update(select={"tme": "2000-01-01"}),
        ["the selection names dims the cube does not have", "Did you mean 'time'?"],
    ),
    "selection that matches nothing": (
        lambda t, c: c["load"].update(select={"time": "1850-01-01"}),
        ["the selection along 'time' matches nothing", 'load.select.time="1850-01-01"'],
    ),
    "dim that does not exist": (
        lambda t, c: c["load"].update(obs_dim="tme"),
        ["load.obs_dim 'tme' is not a dim", "Did you mean 'time'?"],
    ),
    "obs length differs from design rows": (
        lambda t, c: (
            cube_with(
                t,
                c,
                lambda ds: ds.assign(A=(("t5", "coef"), np.ones((5, 3)))),
                variable="signal",
                design="A",
            ),
            c.update(design={"impl": "variable"}),
        ),
        ["with 12 rows (one per observation), found (t5=5, coef=3)"],
    ),
    "non-numeric dtype": (
        lambda t, c: cube_with(t, c, lambda ds: ds.assign(signal=ds["signal"].astype(str))),
        ["has dtype <U", "expected numbers"],
    ),
    "all-NaN cube": (
        lambda t, c: cube_with(t, c, lambda ds: ds.assign(signal=ds["signal"] * np.nan)),
        ["entirely NaN"],
    ),
    "inf values": (
        lambda t, c: cube_with(
            t, c, lambda ds: ds.assign(signal=ds["signal"].where(ds["signal"] < 2.5, np.inf))
        ),
        ["infinite value(s) (first at", "replace infinite"],
    ),
    "design with NaN": (
        lambda t, c: (
            cube_with(t, c, _design_nan, variable="signal", design="A"),
            c.update(design={"impl": "variable"}),
        ),
        ["design 'A' holds 1 NaN"],
    ),
    "NaT in the obs coordinate": (
        lambda t, c: cube_with(t, c, _nat_time),
        ["obs coordinate 'time' holds 1 NaT value(s) (first at time=4)", "finite 'time' value"],
    ),
    "weights all zero": (
        lambda t, c: cube_with(
            t, c, lambda ds: ds.assign(w=("time", np.zeros(12))), variable="signal", weights="w"
        ),
        ["weights 'w' are all zero: no observation has weight > 0", "check load.weights"],
    ),
    "NaN and negative weights": (
        lambda t, c: cube_with(
            t,
            c,
            lambda ds: ds.assign(w=("time", np.r_[np.nan, -1.0, np.ones(10)])),
            variable="signal",
            weights="w",
        ),
        ["must be finite and ≥ 0; found 1 NaN", "a weight of 0 drops its observation"],
    ),
    "values beyond float32": (
        lambda t, c: cube_with(t, c, lambda ds: ds.assign(signal=ds["signal"] * 1e40)),
        ["the cube's values do not fit float32", "set solve.dtype: float64"],
    ),
    "rank-deficient design under cholesky": (
        lambda t, c: (
            cube_with(t, c, _rank_deficient, variable="signal", design="A"),
            c.update(design={"impl": "variable"}, solve={"policy": "cholesky"}),
        ),
        ["policy cholesky cannot solve this design", "rank 3 < coef 4", "solve.policy: minnorm"],
    ),
    "model input shape does not hold coef": (
        lambda t, c: c["model"].update(input_dim=3),
        ["input shape multiplying to coef = 4", "found:    input shape (3, 2)"],
    ),
    "checkpoint shapes do not match": (
        _checkpoint_shapes,
        ["do not fit the model", "weight: file has shape (2, 2, 3), the model needs (2, 2, 2)"],
    ),
    "checkpoint is a pickle of objects": (
        _pickled_code,
        ["refused to load", "never unpickles arbitrary objects", "safetensors"],
    ),
    "unknown implementation": (
        lambda t, c: (
            c["solve"].update(impl="lsqr") if "solve" in c else c.update(solve={"impl": "lsqr"})
        ),
        ["unknown solve implementation 'lsqr'", "known: curvefit, lstsq", "Did you mean 'lstsq'?"],
    ),
    "unknown key": (
        lambda t, c: c["write"].update(compresion=9),
        ["write.compresion: unknown key"],
    ),
}


def run_cli(cfg_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["run", str(cfg_path)])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    setup, needles = CASES[case]
    cfg = base(tmp_path)
    setup(tmp_path, cfg)
    cfg_path = tmp_path / "gridsolve.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    code, err = run_cli(cfg_path, capsys)
    assert code == 2, (code, err)
    message = err.strip().splitlines()
    assert message and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    # printed once: the console shows Prefect's run log, which leaves the message out
    first = [line for line in message if line.startswith(KINDS)]
    assert len(first) == 1, err
    # a stage's message carries its kind and implementation, as docs/failures.md shows them
    label = re.match(r"^[a-z ]+: \[([^\]]+)\]", first[0])
    assert label is None or re.fullmatch(r"[a-z_]+/[a-z_0-9]+", label[1]), first[0]
    out = Path(cfg["write"]["path"])
    assert not out.exists()
    assert not list(out.parent.glob("*.tmp")) if out.parent.exists() else True
    assert not Path("/tmp/gridsolve-pwned").exists()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[..., Path | None]]:
    """Mount small tmpfs folders where the OS allows it (root with CAP_SYS_ADMIN)."""
    mounted: list[Path] = []

    def mount(name: str, size: str, read_only: bool = False) -> Path | None:
        target = tmp_path / name
        target.mkdir()
        opts = f"size={size}" + (",ro" if read_only else "")
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(target)], capture_output=True
        )
        if res.returncode != 0:
            return None
        mounted.append(target)
        return target

    yield mount
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def test_output_folder_not_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tmpfs: Any
) -> None:
    cfg = base(tmp_path)
    ro = tmpfs("ro", "1m", read_only=True)
    # Without a mount: a folder the OS refuses to create, even for root.
    target = Path("/proc/gridsolve-out/result.nc") if ro is None else ro / "result.nc"
    cfg["write"]["path"] = str(target)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code, err = run_cli(tmp_path / "c.yaml", capsys)
    assert code == 2 and "Traceback" not in err
    assert "is not writable" in err or "cannot create the output folder" in err, err
    assert not target.exists()


def test_a_folder_that_refuses_files_is_not_reported_as_a_full_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # /proc exists, passes root's access check, has no free space and refuses new
    # files: the message named a full disk and told the user to free space.
    cfg = base(tmp_path)
    target = Path("/proc/gridsolve-result.nc")
    cfg["write"]["path"] = str(target)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code, err = run_cli(tmp_path / "c.yaml", capsys)
    assert code == 2 and "Traceback" not in err
    assert "no space left" not in err, err
    assert "not allowed to write there" in err or "is not writable" in err, err
    assert not target.exists()


def test_cache_disk_full_during_the_model_stage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tmpfs: Any
) -> None:
    # The model stage fills its outputs in mapped files of the cache: on a full disk that
    # would kill the process (SIGBUS) unless the blocks are reserved first, as they are.
    small = tmpfs("cache", "3m")
    if small is None:
        pytest.skip("needs a small tmpfs (root with CAP_SYS_ADMIN), as CI has")
    cube = tmp_path / "big.nc"
    make_ds(n_obs=12, ny=60, nx=60).to_netcdf(cube)  # model outputs: 5.5 MB
    cfg = base(tmp_path)
    cfg["load"]["path"] = str(cube)
    cfg["model"] = {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 64}
    cfg["cache"]["root"] = str(small)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code, err = run_cli(tmp_path / "c.yaml", capsys)
    assert code == 2 and "Traceback" not in err, err
    first = [line for line in err.splitlines() if "no space left" in line]
    assert first and "model" in first[0] and "cache folder" in first[0], err
    assert "cache.root" in err
    assert not Path(cfg["write"]["path"]).exists()
    assert list((small / "tmp").iterdir()) == []  # nothing staged is left behind


def test_disk_full_during_write(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tmpfs: Any
) -> None:
    cube = tmp_path / "big.nc"
    make_ds(n_obs=12, ny=60, nx=60).to_netcdf(cube)
    cfg = base(tmp_path)
    cfg["load"]["path"] = str(cube)
    cfg["model"] = {"impl": "multidim_linear", "input_dim": 2, "hidden_dim": 2, "output_dim": 64}
    cfg["write"]["zlib"] = False
    small = tmpfs("small", "256k")
    if small is not None:  # a real full disk
        cfg["write"]["path"] = str(small / "result.nc")
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        code, err = run_cli(tmp_path / "c.yaml", capsys)
        assert code == 2 and "Traceback" not in err
        assert "no space left" in err, err
        assert list(small.iterdir()) == []  # neither the file nor its temporary
        return
    # No mount allowed: the same failure from a file size limit on a real process.
    cfg["write"]["path"] = str(tmp_path / "out" / "result.nc")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    main(["run", str(tmp_path / "c.yaml"), "--set", f"write.path={tmp_path / 'warm.nc'}"])
    capsys.readouterr()
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000)); "
        "from flows.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, "run", str(tmp_path / "c.yaml")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "no space left" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "out" / "result.nc").exists()
    assert not list((tmp_path / "out").glob("*.tmp"))


# ---------------------------------------------------------------- object storage
BUCKET_CASES: dict[str, tuple[str, list[str]]] = {
    "input bucket missing": ("load", ["input error: [load", "bucket 'no-such-bucket'"]),
    "output bucket missing": (
        "write",
        ["output error: [write", "bucket 'no-such-bucket' of output s3://no-such-bucket/out/"],
    ),
    "cache bucket missing": ("cache", ["store error:", "bucket 'no-such-bucket'"]),
    "glob matches no object": ("glob", ["input error: [load", "matches no object"]),
    "wrong secret": ("secret", ["refused access", "AWS_SECRET_ACCESS_KEY"]),
    "secret in the config": ("config", ["config error:", "may not hold credentials"]),
}


@pytest.mark.parametrize("case", list(BUCKET_CASES))
def test_bad_bucket(
    case: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    s3: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    what, needles = BUCKET_CASES[case]
    cfg = base(tmp_path)
    s3.fs.put_file(cfg["load"]["path"], f"{s3.bucket}/cube.nc")
    cfg["load"]["path"] = s3.url("cube.nc")
    cfg["write"]["path"] = s3.url("out/result.nc")
    if what in ("load", "write"):
        section = {"load": "load", "write": "write"}[what]
        cfg[section]["path"] = cfg[section]["path"].replace(s3.bucket, "no-such-bucket")
    elif what == "cache":
        cfg["cache"]["root"] = "s3://no-such-bucket/cache"
    elif what == "glob":
        cfg["load"]["path"] = s3.url("sst-*.nc")
    elif what == "secret":
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
        from s3server import forget_filesystems

        forget_filesystems()
    else:
        cfg["cache"]["storage_options"] = {"secret": "pasted-secret-value"}
    cfg_path = tmp_path / "gridsolve.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    code, err = run_cli(cfg_path, capsys)
    assert code == 2, (code, err)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    message = err.strip().splitlines()
    assert len([line for line in message if line.startswith(KINDS)]) == 1, err
    assert "not-the-secret" not in err and "pasted-secret-value" not in err
    assert s3.server.secret not in err
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.server.secret)
    assert s3.objects() == ["cube.nc"]  # nothing else written: no output, no cache


# ---------------------------------------------------------------- what a worker may read
@pytest.mark.slow  # ≥ 5 s beside a CPU hog: in CI, not in the fast tier
def test_inputs_outside_the_allowed_roots_are_refused_before_any_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = base(tmp_path)  # the cube is in tmp_path itself
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    # a link inside the allowed folder that leads outside it is outside too
    (allowed / "link.nc").symlink_to(tmp_path / "cube.nc")
    monkeypatch.setenv("GRIDSOLVE_ALLOWED_INPUTS", f"{allowed} s3://data/in")
    for path in (str(tmp_path / "cube.nc"), str(allowed / "*.nc")):
        cfg["load"]["path"] = path
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        code, err = run_cli(tmp_path / "c.yaml", capsys)
        assert code == 2 and "Traceback" not in err, err
        assert "is outside the places this worker may read from" in err, err
        assert "GRIDSOLVE_ALLOWED_INPUTS" in err
        assert not (tmp_path / "cache" / "objects").exists()  # nothing was read or computed
    # inside: runs
    (allowed / "real.nc").write_bytes((tmp_path / "cube.nc").read_bytes())
    cfg["load"]["path"] = str(allowed / "real.nc")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    assert run_cli(tmp_path / "c.yaml", capsys)[0] == 0


def test_a_model_module_outside_the_allowed_prefixes_is_never_imported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "evil_models.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def forward(self, x):\n"
        "        return x\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("GRIDSOLVE_ALLOWED_MODULES", "mylab.models gridsolve")
    cfg = base(tmp_path)
    cfg["model"] = {"impl": "module", "target": "evil_models:Net", "input_shape": [4]}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    code, err = run_cli(tmp_path / "c.yaml", capsys)
    assert code == 2 and "Traceback" not in err, err
    assert "model.target module 'evil_models' is not one this worker may import" in err, err
    assert not marker.exists()
