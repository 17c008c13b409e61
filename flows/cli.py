"""The ``gridsolve`` command line.

Every user-facing failure is a :class:`GridsolveError`: printed as one message
without a traceback, exit status 2. ``--debug`` shows tracebacks.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gridsolve.flows.cachecmd import add_parser as add_cache_parser
from gridsolve.flows.cachecmd import cmd_cache
from gridsolve.schemas.errors import EXIT_CODE, ConfigError, GridsolveError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gridsolve",
        description="Per-pixel least squares and per-sample model gradients over NetCDF cubes, "
        "as a cached Prefect pipeline.",
    )
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="write a demo cube and config, then run the pipeline on it")
    d.add_argument(
        "--out", default="gridsolve-demo", help="folder for the cube, config, cache and output"
    )
    d.add_argument(
        "--size",
        choices=["small", "seed"],
        default="small",
        help="small: 50×64×64; seed: 50×500×500 with 100 coefficients (the original problem)",
    )
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    r = sub.add_parser("run", help="run the pipeline on a config file")
    r.add_argument("config", help="YAML config file")
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one field, e.g. --set solve.ridge=0.1 (repeatable)",
    )
    r.add_argument(
        "--profile",
        action="store_true",
        help="also print where the run's time went: imports, Prefect, each stage's phases",
    )

    v = sub.add_parser("validate", help="check a config file (and the input file's structure)")
    v.add_argument("config")
    v.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    sub.add_parser("schema", help="print the JSON schema of the config")
    sub.add_parser(
        "stages", help="list the stage kinds in run order and the implementations of each"
    )

    srv = sub.add_parser("server", help="start a local Prefect server (UI and API) on 127.0.0.1")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    srv.add_argument("--port", type=int, default=4200)

    dep = sub.add_parser(
        "deploy", help="create the process work pool and the deployments of prefect.yaml"
    )
    dep.add_argument("--project", default=None, help="folder holding prefect.yaml")
    dep.add_argument("--pool", default=POOL)

    wrk = sub.add_parser("worker", help="start a Prefect worker on the gridsolve work pool")
    wrk.add_argument("--pool", default=POOL)
    srv = sub.add_parser(
        "serve",
        help="serve the nightly and on-demand deployments from this process (no pool, no worker)",
    )
    for runner in (wrk, srv):
        runner.add_argument(
            "--unconfined",
            action="store_true",
            help="let runs read, write and import anywhere this user can (default: inputs "
            "under $GRIDSOLVE_HOME/data, outputs and caches under $GRIDSOLVE_HOME, models "
            "from gridsolve; GRIDSOLVE_ALLOWED_* set in the environment win)",
        )
    add_cache_parser(sub)
    return p


POOL = "gridsolve-process"


def _prefect(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


#: How often `gridsolve worker` asks the server for runs (PREFECT_WORKER_QUERY_SECONDS wins).
WORKER_QUERY_SECONDS = 0.5


def _prefect_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    env.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "gridsolve")
    env.update(extra)
    return env


def _project(folder: str | None) -> Path:
    if folder is not None:
        root = Path(folder)
    elif (Path.cwd() / "prefect.yaml").is_file():
        root = Path.cwd()
    else:
        root = Path(__file__).resolve().parent.parent
    if not (root / "prefect.yaml").is_file():
        raise ConfigError(
            f"no prefect.yaml in {root}",
            fix="run from the gridsolve checkout, or pass --project FOLDER",
        )
    return root


def _need_api() -> str:
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        raise ConfigError(
            "PREFECT_API_URL is not set: deployments live on a Prefect server",
            fix="start one with `gridsolve server`, then "
            "`export PREFECT_API_URL=http://127.0.0.1:4200/api`",
        )
    _check_login(url)
    return url


def _check_login(api: str) -> None:
    """A ConfigError when a server with basic auth refuses this client's login (or lack of it)."""
    from gridsolve.flows.localserver import api_refusal

    if api_refusal(api, None) is None:
        return  # no login asked for: the wrappers stay small (no prefect import here)
    # as Prefect reads it: the environment, else the profile (`prefect config set`)
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if auth is None:
        from prefect.settings import get_current_settings

        secret = get_current_settings().api.auth_string
        auth = secret.get_secret_value() if secret is not None else None
    refusal = api_refusal(api, auth)
    if refusal is not None:
        raise ConfigError(
            refusal,
            fix="export PREFECT_API_AUTH_STRING=user:password, the server's "
            "PREFECT_SERVER_API_AUTH_STRING (every client, worker and Dask worker needs it)",
        )


def cmd_server(args: argparse.Namespace) -> int:
    """Run `prefect server start` in the foreground, with the UI pointed at itself.

    Stopping this process (Ctrl-C, SIGTERM, SIGHUP) stops the server and all it started.
    """
    from gridsolve.flows.localserver import (
        LocalServer,
        database_summary,
        port_in_use,
        supervise,
    )

    home = Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))
    if port_in_use(args.host, args.port):
        raise ConfigError(
            f"port {args.port} on {args.host} is already in use (another Prefect server?)",
            fix="stop that process, or choose another port: gridsolve server --port 4300",
        )
    server = LocalServer(home, port=args.port, host=args.host)
    print(database_summary())
    print(f"Prefect UI at {server.url}; in other shells:\n  export PREFECT_API_URL={server.api}")
    if os.environ.get("PREFECT_SERVER_API_AUTH_STRING"):
        # the secret is never printed: the user set it and knows it
        print("  export PREFECT_API_AUTH_STRING=…  # the same user:password as this server's")
    elif args.host not in ("127.0.0.1", "localhost", "::1"):
        print(
            f"warning: anyone who reaches {args.host}:{args.port} can start runs; set "
            "PREFECT_SERVER_API_AUTH_STRING=user:password for this server (docs/team.md)"
        )
    print("Stop with Ctrl-C or SIGTERM: the server and everything it started stop with it.")
    sys.stdout.flush()
    return supervise(server.command(), server.env())


def locked_job_template() -> dict[str, Any]:
    """The process pool's base job template: a run's job variables change nothing but names.

    Only its name, labels and output streaming stay variables. Prefect's default
    lets a run's job variables set the process's environment, its command and its
    working folder: a UI "Custom run" could lift the worker's confinement
    (GRIDSOLVE_ALLOWED_*) or run any command. Here the environment is the worker's
    own, the command the worker's flow-run engine and the folder the worker's
    default.
    """
    from prefect.workers.process import ProcessWorker

    base: dict[str, Any] = ProcessWorker.get_default_base_job_template()
    conf = base["job_configuration"]
    # No env at all: Prefect merges a run's env job variable into a fixed env mapping
    # (prefect/workers/base.py, from_template_and_values); the worker's own environment
    # (with PREFECT_LOGGING_EXTRA_LOGGERS, see cmd_worker) is the runs'.
    del conf["env"]
    conf["command"] = None
    conf["working_dir"] = None
    for name in ("env", "command", "working_dir"):
        base["variables"]["properties"].pop(name, None)
    return base


def cmd_deploy(args: argparse.Namespace) -> int:
    """Create the work pool (if missing), every deployment of prefect.yaml, the automations."""
    from gridsolve.flows.automations import install_automations, silent_seconds

    _need_api()
    silent_seconds()  # a window that would crash live runs is refused before any change
    root = _project(args.project)
    env = _prefect_env()
    inspect = subprocess.run(
        _prefect("work-pool", "inspect", args.pool), env=env, capture_output=True, text=True
    )
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "job-template.json"
        template.write_text(json.dumps(locked_job_template()))
        how = ["update", args.pool] if inspect.returncode == 0 else ["create", args.pool]
        how += [] if inspect.returncode == 0 else ["--type", "process"]
        made = _prefect_said(_prefect("work-pool", *how, "--base-job-template", str(template)), env)
    if made != 0:
        return made
    deployed = _prefect_said(_prefect("--no-prompt", "deploy", "--all"), env, root)
    if deployed != 0:
        return deployed
    for name in install_automations():
        print(f"automation: {name}")
    return 0


_PREFECT_WORKER = re.compile(r"prefect worker start --pool ('[^']*'|\S+)")


def _prefect_said(cmd: list[str], env: Mapping[str, str], cwd: Path | None = None) -> int:
    """Run a prefect command, its output passed through with its worker hints made ours."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        # Prefect suggests its own worker; ours stops with its parent (docs/team.md)
        sys.stdout.write(_PREFECT_WORKER.sub(r"gridsolve worker --pool \1", line))
        sys.stdout.flush()
    return proc.wait()


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a Prefect worker on the pool in the foreground; it stops with this process."""
    from gridsolve.flows.localserver import supervise
    from gridsolve.schemas.confinement import confine, deployment_home

    _need_api()
    env = _prefect_env()
    # Runs triggered by others are confined unless the operator says otherwise.
    print(f"gridsolve worker: {confine(env, deployment_home(), args.unconfined)}", flush=True)
    # Prefect polls every 10 s by default, so a run triggered in the UI waited 5 s on
    # average before anything happened; two polls a second cost the server little
    # (one read of the pool's queues) and keep trigger → Completed of a cached run
    # under 4 s (benchmarks/bench_pipeline.py --case overhead).
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", str(WORKER_QUERY_SECONDS))
    # Prefect's worker does not end on SIGTERM (a clean stop ends with the SIGKILL after
    # the grace): if this supervisor is killed outright, the worker is killed too, or it
    # would stay online, taking runs, beside the one a restart starts.
    return supervise(
        _prefect("worker", "start", "--pool", args.pool), env, death_signal=signal.SIGKILL
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve both deployments from this process (a lighter alternative to pool + worker)."""
    from gridsolve.schemas.confinement import confine, deployment_home

    _need_api()
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "gridsolve")
    env = dict(os.environ)
    print(f"gridsolve serve: {confine(env, deployment_home(), args.unconfined)}", flush=True)
    os.environ.update(env)
    from prefect import serve
    from prefect.deployments.runner import RunnerDeployment

    from gridsolve.flows.pipeline import pipeline

    nightly = pipeline.to_deployment(
        name="nightly",
        cron="0 2 * * *",
        parameters={
            "write": {"impl": "netcdf", "path": "outputs/nightly/gridsolve-{scheduled_date}.nc"}
        },
    )
    on_demand = pipeline.to_deployment(
        name="on-demand",
        parameters={
            "write": {"impl": "netcdf", "path": "outputs/on-demand/gridsolve-{flow_run_name}.nc"}
        },
    )
    assert isinstance(nightly, RunnerDeployment) and isinstance(on_demand, RunnerDeployment)
    serve(nightly, on_demand)
    return 0


def _demo_config() -> dict[str, Any]:
    """The embedded default run reading the demo cube from a file (`gridsolve demo` writes it)."""
    from gridsolve.schemas.pipeline import DEMO, section

    return {
        "load": {"impl": "netcdf", "path": "demo.nc", "variable": "signal"},
        "design": section(DEMO.design),
        "solve": {
            "impl": "lstsq",
            "policy": "minnorm",
            "dtype": "float32",
            "uncertainty": "stderr",
        },
        "model": section(DEMO.model),
        "write": {"impl": "netcdf", "path": "output.nc"},
        "cache": {"root": ".cache"},
    }


def _trend_config() -> dict[str, Any]:
    """The demo cube fitted with a trend design, standard errors on (docs/output.md)."""
    return {
        "load": {"impl": "netcdf", "path": "demo.nc", "variable": "signal"},
        "design": {"impl": "harmonic", "harmonics": 1},
        "solve": {"impl": "lstsq", "uncertainty": "stderr"},
        "write": {"impl": "netcdf", "path": "trend.nc"},
        "cache": {"root": ".cache"},
    }


def _train_config() -> dict[str, Any]:
    """The demo cube's model trained to predict the seasonal range (docs/recipes/training.md)."""
    return {
        "load": {
            "impl": "netcdf",
            "path": "demo.nc",
            "variable": "signal",
            "target": "seasonal_range",
        },
        "design": {"impl": "harmonic", "harmonics": 1},
        "train": {
            "impl": "adam",
            "epochs": 30,
            "batch_pixels": 256,
            "lr": 0.05,
            "clip_norm": 1.0,
            "validation_fraction": 0.1,
            "early_stopping": 5,
        },
        "model": {
            "impl": "multidim_linear",
            "input_dim": 2,
            "hidden_dim": 2,
            "output_dim": 1,
            "objective": "mse",
        },
        "write": {"impl": "netcdf", "path": "train.nc"},
        "cache": {"root": ".cache"},
    }


def cmd_demo(args: argparse.Namespace) -> int:
    """Write the demo cube and config under ``--out``, then run them."""
    from gridsolve.schemas.errors import OutputError
    from gridsolve.stages.load.demo import SIZES, make_cube, write_atomic

    out = Path(args.out).resolve()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(
            f"cannot create {out}: {exc.strerror}", fix="choose a writable --out folder"
        ) from exc
    cube = out / "demo.nc"
    stamp = out / f".demo-{args.size}"
    if not (cube.exists() and stamp.exists()):
        for old in out.glob(".demo-*"):
            old.unlink()
        write_atomic(make_cube(*SIZES[args.size], seed=0), cube)
        stamp.touch()
    config = out / "gridsolve.yaml"
    config.write_text(
        "# gridsolve demo config: edit and rerun with `gridsolve run gridsolve.yaml`\n"
        + yaml.safe_dump(_demo_config(), sort_keys=False)
    )
    trend = out / "trend.yaml"
    trend.write_text(
        "# Is the trend significant? `gridsolve run trend.yaml` (docs/output.md)\n"
        + yaml.safe_dump(_trend_config(), sort_keys=False)
    )
    train = out / "train.yaml"
    train.write_text(
        "# Train the model to predict the seasonal range: `gridsolve run train.yaml` "
        "(docs/recipes/training.md)\n" + yaml.safe_dump(_train_config(), sort_keys=False)
    )
    print(f"demo cube {cube} ({args.size}), config {config} (and {trend.name}, {train.name})")
    return _run(config, args.overrides, args.debug)


def _run(
    config_path: Path, overrides: Sequence[str], debug: bool = False, profile: bool = False
) -> int:
    from gridsolve.flows.failures import install
    from gridsolve.flows.pipeline import run_config
    from gridsolve.schemas.reading import load_config
    from gridsolve.stages.engine import timing
    from gridsolve.stages.engine.overlap import refuse_destructive_outputs

    timing.mark("imported")

    if not debug:
        install(cli=True)  # main() prints a user error; Prefect's console log must not repeat it
    cfg = load_config(config_path, overrides)
    # Before Prefect starts: nothing is written when the output would replace an input.
    refuse_destructive_outputs(cfg, config_path, local_template_values())
    if os.environ.get("PREFECT_API_URL"):
        _check_login(os.environ["PREFECT_API_URL"])  # before any work, not as a traceback after
    summary = run_config(cfg, config_path)
    print(summary.table())
    print(f"tiles: {summary.tiles}")
    for kind, counts in summary.counts.items():
        print(f"status of {kind}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    print(f"output: {summary.output}")
    if profile:
        from gridsolve.flows.reporting import profile_table

        table, _ = profile_table(summary, timing.MARKS, timing.process_start(), time.time())
        print(table)
    return 0


def local_template_values() -> dict[str, str]:
    """Placeholder values as a run started now fills them; a flow run's name is not known yet."""
    from datetime import UTC, datetime

    from gridsolve.schemas.templating import template_values

    return template_values(
        now=datetime.now(UTC), scheduled=None, flow_run_name=None, flow_run_id=None, deployment=None
    )


def cmd_run(args: argparse.Namespace) -> int:
    """Run a config file."""
    return _run(Path(args.config), args.overrides, args.debug, args.profile)


def cmd_validate(args: argparse.Namespace) -> int:
    """Validate a config; open the input, import the model class, probe the buckets.

    Probing a bucket writes and deletes one small object; a NetCDF object is
    opened from its local copy (made under GRIDSOLVE_MIRROR).
    """
    from gridsolve.schemas.kinds.load import NetCDFLoad
    from gridsolve.schemas.kinds.model import ModuleModel
    from gridsolve.schemas.kinds.solve import CurvefitSolve
    from gridsolve.schemas.reading import config_to_yaml, load_config
    from gridsolve.stages.engine import storage
    from gridsolve.stages.engine.overlap import refuse_destructive_outputs
    from gridsolve.stages.engine.store import open_store
    from gridsolve.stages.load.inputs import check_opens
    from gridsolve.stages.write.target import check_write_target

    cfg = load_config(args.config, args.overrides)
    refuse_destructive_outputs(cfg, args.config, local_template_values())
    if isinstance(cfg.load, NetCDFLoad) and "{" not in str(cfg.load.path):
        check_opens(cfg.load)
    if "{" not in str(getattr(cfg.write, "path", "")):
        check_write_target(cfg.write)
    if storage.at(cfg.cache.root).shared() is not None:  # a local folder is not created here
        open_store(cfg.cache.root, cfg.cache.storage_options)  # probes the bucket
    if isinstance(cfg.model, ModuleModel):
        # Only here is torch imported: the class the config names needs it anyway.
        from gridsolve.stages.model.building import import_target

        import_target(cfg.model.target, "model")
    if isinstance(cfg.solve, CurvefitSolve):  # imported and tried on one pixel, as a run does
        from gridsolve.stages.solve.curvefit import check_function

        check_function(cfg.solve)
    print(config_to_yaml(cfg), end="")
    print("config is valid")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    """Print the config's JSON schema."""
    from gridsolve.schemas.pipeline import PipelineConfig

    print(json.dumps(PipelineConfig.model_json_schema(), indent=2))
    return 0


def cmd_stages(args: argparse.Namespace) -> int:
    """Print each stage kind (what it makes) and its registered implementations, plugins too."""
    from gridsolve.schemas.pipeline import DEFAULT_IMPL, STAGE_KINDS
    from gridsolve.stages.engine.contract import contract_of
    from gridsolve.stages.engine.registry import implementations

    for kind in STAGE_KINDS:
        contract = contract_of(kind)
        made = f": {contract.summary}" if contract and contract.summary else ""
        how = "tile by tile" if contract and contract.tiled else "whole"
        print(f"{kind} ({how}){made}")
        for impl, decl in sorted(implementations(kind).items()):
            mark = " (default)" if DEFAULT_IMPL.get(kind) == impl else ""
            print(f"  {impl}{mark}: {decl.summary or decl.config.__doc__ or ''}".rstrip())
    return 0


COMMANDS = {
    "demo": cmd_demo,
    "run": cmd_run,
    "validate": cmd_validate,
    "schema": cmd_schema,
    "stages": cmd_stages,
    "server": cmd_server,
    "deploy": cmd_deploy,
    "worker": cmd_worker,
    "serve": cmd_serve,
    "cache": cmd_cache,
}


#: Commands that only start Prefect processes: they import no stage (no torch), so the
#: wrapper that stays to supervise them is small.
_LAUNCHERS = frozenset({"server", "worker", "deploy"})

#: How long a run waits for Prefect's temporary server (see main), unless the environment
#: sets it.
STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
STARTUP_TIMEOUT_S = "120"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gridsolve`` command."""
    # numpy/scipy's BLAS (OpenBLAS) only ever sees gridsolve's small designs, but its
    # threads, once woken, spin on the cores that torch's large products need next
    # (measured: the dense solve 58 ms instead of 35 ms on 2 cores). One thread, unless
    # the user set it; before numpy loads, and inherited by the flow-run processes.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    args = _parser().parse_args(argv)
    # The process ends after the command: the garbage collection of every object at exit
    # cost 0.5-0.7 s of a 3.8 s cached run here and frees nothing the operating system
    # does not. Frozen objects are skipped by it; the other atexit handlers (Prefect's log
    # and event flushes) run all the same.
    atexit.register(gc.freeze)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Without PREFECT_API_URL Prefect starts a temporary server and waits 20 s for it. Its
    # first start on a fresh PREFECT_HOME creates the database; on a loaded 2-core host
    # that took longer (CI, 2026-12-07) and the run ended in a traceback. The wait ends as
    # soon as the server answers, so a longer limit costs nothing. A value in the environment
    # wins; one in a Prefect profile does not (the environment outranks profiles, and
    # reading the profile here would import Prefect's settings before every command).
    os.environ.setdefault(STARTUP_TIMEOUT_ENV, STARTUP_TIMEOUT_S)
    if os.environ.get("PREFECT_API_URL") == "":
        # Set but empty (`PREFECT_API_URL= gridsolve …`) means unset, as for the user;
        # Prefect would start its temporary server and then fail to send it events.
        del os.environ["PREFECT_API_URL"]
    if not args.debug:
        logging.getLogger("gridsolve").setLevel(logging.WARNING)
    try:
        if args.command not in _LAUNCHERS:
            import gridsolve.stages  # noqa: F401  (registers built-in implementations)

        return COMMANDS[args.command](args)
    except GridsolveError as exc:
        if args.debug:
            raise
        print(str(exc), file=sys.stderr)
        return EXIT_CODE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
