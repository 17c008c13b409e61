"""Marks that tell gridsolve's files beside an output from a user's (engine/provenance.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np
from matplotlib.figure import Figure
from safetensors.numpy import save_file

from gridsolve.report import drawing
from gridsolve.stages.engine.provenance import is_gridsolve_side_file, png_text
from gridsolve.stages.engine.store import Artifact
from gridsolve.stages.train.outputs import weights_path, write_weights


class _Trained:
    """What write_weights reads of a train artifact: its arrays."""

    def arrays(self) -> dict[str, np.ndarray]:
        return {"param:w": np.arange(6.0).reshape(2, 3), "param:b": np.zeros(2)}


def test_the_weights_gridsolve_writes_are_marked(tmp_path: Path) -> None:
    out = tmp_path / "out.nc"
    write_weights(cast(Artifact, _Trained()), weights_path(out))
    assert is_gridsolve_side_file(weights_path(out))


def test_a_users_safetensors_file_is_not_gridsolve_s(tmp_path: Path) -> None:
    theirs = tmp_path / "out.nc.weights.safetensors"
    save_file({"w": np.ones(3)}, str(theirs))
    assert not is_gridsolve_side_file(theirs)
    save_file({"w": np.ones(3)}, str(theirs), metadata={"gridsolve": "mine"})
    assert not is_gridsolve_side_file(theirs)
    theirs.write_bytes(b"\xff" * 8 + b"not a header")
    assert not is_gridsolve_side_file(theirs)


def test_every_picture_gridsolve_draws_is_marked(tmp_path: Path) -> None:
    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    png = drawing.to_png(fig)  # the loss picture's and the quick-look's encoder
    meta: Any = png_text(png)
    assert meta["gridsolve"] and "gridsolve-output" not in meta
    path = tmp_path / "out.nc.loss.png"
    path.write_bytes(png)
    assert is_gridsolve_side_file(path)


def test_a_users_picture_is_not_gridsolve_s(tmp_path: Path) -> None:
    fig = Figure()
    fig.subplots().plot([0, 1], [1, 0])
    path = tmp_path / "out.nc.quicklook.png"
    fig.savefig(path, format="png")  # matplotlib's own text keys, no gridsolve mark
    assert not is_gridsolve_side_file(path)
    path.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert not is_gridsolve_side_file(path)
    assert not is_gridsolve_side_file(tmp_path / "missing.png")


def test_a_quick_look_of_an_earlier_version_keeps_its_stamp_as_a_mark(tmp_path: Path) -> None:
    fig = Figure()
    path = tmp_path / "out.nc.quicklook.png"
    fig.savefig(path, format="png", metadata={"gridsolve-output": '["out.nc", 1]'})
    assert is_gridsolve_side_file(path)


def test_a_stamp_in_an_international_text_chunk_is_read(tmp_path: Path) -> None:
    """Pillow writes a value that is not Latin-1 (a path in Greek) as iTXt."""
    fig = Figure()
    path = tmp_path / "out.nc.quicklook.png"
    fig.savefig(path, format="png", metadata={"gridsolve-output": '["/δεδομένα/out.nc", 1]'})
    assert png_text(path.read_bytes())["gridsolve-output"] == '["/δεδομένα/out.nc", 1]'
    assert is_gridsolve_side_file(path)
