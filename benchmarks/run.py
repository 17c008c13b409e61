"""All benchmarks in one command: each script in turn, then one table of every target.

Each benchmark measures its rows side by side in one run and prints verdict lines
``<figure> = <value> (target <op> <bound>: met|NOT met)``; this runs them one after
the other (the machine has 2 cores: never two at once), keeps each full output under
``--out``, and ends with the table of every verdict line, so one command answers
"where do we stand on every speed and memory target".

Usage: python benchmarks/run.py [solve] [model] [pipeline] [train] [cluster] [e2e] [curvefit]
       [--out FOLDER] [--readme]  (--readme: write the table into README.md, too)
       [--mkl-path AVX2|AVX512|COMPATIBLE]  (torch's MKL code path of another CPU: sets
       MKL_CBWR for every benchmark, as the machine line then says)
       (no names: all of them; peers come from the ``bench`` extra:
       pip install -e '.[bench]')
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from common import into_readme, machine

HERE = Path(__file__).resolve().parent
BENCHMARKS = {
    "solve": "bench_solve.py",
    "model": "bench_model.py",
    "pipeline": "bench_pipeline.py",
    "train": "bench_train.py",
    "cluster": "bench_cluster.py",
    "e2e": "bench_e2e.py",
    "curvefit": "bench_curvefit.py",
}
VERDICT = re.compile(r"^(?P<figure>.+?)\s*\(target (?P<target>[^:]+):\s*(?P<verdict>.+?)\)\s*$")


def verdicts(text: str) -> list[tuple[str, str, str]]:
    """(figure, target, verdict) of every verdict line in a benchmark's output."""
    out = []
    for line in text.splitlines():
        m = VERDICT.match(line.strip())
        if m:
            out.append((m["figure"].strip(), m["target"].strip(), m["verdict"].strip()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help=f"some of {', '.join(BENCHMARKS)} (default: all)")
    p.add_argument("--out", default="benchmark-results", help="folder for each full output")
    p.add_argument(
        "--readme",
        action="store_true",
        help="also write the table into README.md between its benchmark markers",
    )
    p.add_argument(
        "--mkl-path",
        choices=("AVX2", "AVX512", "COMPATIBLE"),
        help="run torch's MKL on this code path (MKL_CBWR), as on a CPU that has only it",
    )
    args = p.parse_args(argv)
    if args.mkl_path:
        if args.readme:
            p.error("--readme takes the table of the host's own code path: leave out --mkl-path")
        os.environ["MKL_CBWR"] = args.mkl_path  # the benchmarks' processes inherit it
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    names = args.names or list(BENCHMARKS)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[tuple[str, str, str, str]] = []
    failed = []
    for name in names:
        t0 = time.perf_counter()
        print(f"== {name}: python benchmarks/{BENCHMARKS[name]}", flush=True)
        proc = subprocess.run(
            [sys.executable, str(HERE / BENCHMARKS[name])],
            capture_output=True,
            text=True,
            cwd=HERE.parent,
        )
        text = proc.stdout + proc.stderr
        (out / f"{name}.txt").write_text(text)
        print(proc.stdout, flush=True)
        if proc.returncode != 0:
            failed.append(name)
            print(f"   {name} failed (exit {proc.returncode}); see {out / (name + '.txt')}")
        rows += [(name, *v) for v in verdicts(proc.stdout)]
        print(f"   ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(f"\n## every target, one run · {machine()}")
    width = max([len(r[1]) for r in rows] + [6])
    print(f"{'bench':<10}{'figure':<{width + 2}}{'target':<14}verdict")
    for bench, figure, target, verdict in rows:
        print(f"{bench:<10}{figure:<{width + 2}}{target:<14}{verdict}")
    # a row with several figures ("met / met") is met when every one of them is
    met = sum(all(part.strip() == "met" for part in r[3].split("/")) for r in rows)
    print(f"{met} of {len(rows)} targets met; full outputs in {out}/")
    (out / "summary.md").write_text(markdown(rows, names, machine()))
    print(f"markdown table for docs/benchmarks.md: {out / 'summary.md'}")
    if args.readme and not failed:
        readme = HERE.parent / "README.md"
        table = markdown(rows, names, machine())
        readme.write_text(
            into_readme(
                readme.read_text(), "benchmarks", table, "python benchmarks/run.py --readme"
            )
        )
        print(f"wrote the table into {readme}")
    return 1 if failed else 0


def markdown(rows: list[tuple[str, str, str, str]], names: list[str], where: str) -> str:
    """The table of targets as docs/benchmarks.md shows it."""
    lines = [
        f"`python benchmarks/run.py {' '.join(names)}` on {where}, {time.strftime('%Y-%m-%d')}:",
        "",
        "| benchmark | figure | target | verdict |",
        "| --- | --- | --- | --- |",
    ]
    for bench, figure, target, verdict in rows:
        cell = figure.replace("|", "\\|")
        lines.append(f"| {bench} | {cell} | {target} | {verdict} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
