"""``pprun submit``: run any pprun app as a job on a Ray cluster (Ray Jobs), and manage such jobs.

    pprun submit [options] APP [hydra overrides ...]     # e.g. pprun submit generate parallel=pp2_ray
    pprun submit status JOB_ID                           # job status (and its message)
    pprun submit logs JOB_ID [--follow]                  # the job's output so far (or until it ends)
    pprun submit stop JOB_ID                             # stop it; waits until it has stopped

The job server is the cluster's dashboard address (``http://HEAD:8265``): ``--address``, else
``RAY_ADDRESS``.  The job runs ``python -m pprun APP OVERRIDES...`` on the cluster in a runtime
environment that carries

* **pprun itself** (``py_modules``): the package this command runs from, laid out as a wheel would
  be (with its Hydra YAML), so the cluster runs the same code as the submitter; ``--no-ship-pprun``
  uses the pprun installed on the cluster instead;
* **the working directory** (``working_dir``, the current directory by default, ``.gitignore``
  honoured by Ray): input files named by relative paths resolve there; ``--working-dir DIR`` picks
  another, ``--no-working-dir`` sends none;
* **environment variables**: every ``PPRUN_*`` variable set here, and those named by ``--env NAME``
  (this process's value) or ``--env NAME=VALUE``.

By default the command prints the job id, follows the job's logs until it ends and exits with
its status: 0 succeeded, 1 failed, 3 stopped.  ``--no-wait`` prints the job id and returns.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MANAGE_COMMANDS = ("status", "logs", "stop")
"""``pprun submit`` sub-commands that act on an existing job."""

EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}
"""Exit status of ``pprun submit`` (and ``stop``) by the job's final status."""

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
"""Job statuses that do not change any more."""

STOP_WAIT_S = 60.0
"""How long ``pprun submit stop`` waits for the job to reach a final status."""

ENV_PREFIXES = ("PPRUN_",)
"""Environment variables passed to the job without being named."""


def _apps() -> list[str]:
    from pprun.apps import SUBCOMMANDS

    return [name for name in SUBCOMMANDS if name != "submit"]


def job_server_address(address: str | None) -> str:
    """The job server's address: ``address``, else ``RAY_ADDRESS`` (an error naming both when unset)."""
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:
        raise ValueError(
            "no Ray cluster given: pass --address http://HEAD:8265 (the dashboard's address, where the job "
            "server listens) or set RAY_ADDRESS"
        )
    return address


def client(address: str | None) -> Any:
    """A ``JobSubmissionClient`` for the job server (a ValueError naming the address when unreachable)."""
    from ray.job_submission import JobSubmissionClient

    url = job_server_address(address)
    try:
        return JobSubmissionClient(url)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ValueError(f"cannot reach the Ray job server at {url!r}: {e}") from None


def stage_pprun(into: Path) -> Path:
    """Copy the running pprun package into ``into/pprun`` laid out as an installed wheel (its Hydra
    YAML as ``pprun/conf``), for the runtime environment's ``py_modules``; returns the copy."""
    import pprun
    from pprun.config.config import default_conf_dir

    package = Path(pprun.__file__).resolve().parent
    staged = into / "pprun"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(package, staged, ignore=ignore)
    if not (staged / "conf" / "generate.yaml").is_file():
        shutil.copytree(default_conf_dir(), staged / "conf", ignore=ignore, dirs_exist_ok=True)
    return staged


def job_env(names: Sequence[str]) -> dict[str, str]:
    """Environment variables for the job: ``PPRUN_*`` from here, plus ``NAME`` (this process's value)
    or ``NAME=VALUE`` for each of ``names``."""
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    for item in names:
        name, sep, value = item.partition("=")
        if not name:
            raise ValueError(f"--env {item!r} is invalid: use NAME or NAME=VALUE")
        if sep:
            env[name] = value
        elif name in os.environ:
            env[name] = os.environ[name]
        else:
            raise ValueError(f"--env {name}: no such variable is set here; give a value with --env {name}=VALUE")
    return env


def entrypoint(app: str, overrides: Sequence[str]) -> str:
    """The job's shell command: ``python -m pprun APP OVERRIDES...``, each argument quoted."""
    return shlex.join(["python", "-m", "pprun", app, *overrides])


def runtime_env(args: argparse.Namespace, staging: Path) -> dict[str, Any]:
    """The runtime environment the job runs in (see the module docstring)."""
    env: dict[str, Any] = {"env_vars": job_env(args.env)}
    if args.ship_pprun:
        env["py_modules"] = [str(stage_pprun(staging))]
    if not args.no_working_dir:
        working_dir = Path(args.working_dir or os.getcwd()).expanduser().resolve()
        if not working_dir.is_dir():
            raise ValueError(f"--working-dir {str(working_dir)!r} is not a directory")
        env["working_dir"] = str(working_dir)
    return env


def follow_logs(jobs: Any, job_id: str) -> None:
    """Print the job's logs as they come, until the job ends."""

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            sys.stdout.write(chunk)
            sys.stdout.flush()

    asyncio.run(tail())


def wait_final(jobs: Any, job_id: str, timeout_s: float | None = None) -> str:
    """Poll until the job's status is final (or ``timeout_s`` passed); returns the last status seen."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        status = str(jobs.get_job_status(job_id).value)
        if status in TERMINAL or (deadline is not None and time.monotonic() > deadline):
            return status
        time.sleep(0.5)


def _status_line(jobs: Any, job_id: str) -> tuple[str, str]:
    info = jobs.get_job_info(job_id)
    status = str(info.status.value)
    message = f" ({info.message})" if info.message else ""
    return status, f"{job_id}: {status}{message}"


def cmd_submit(args: argparse.Namespace) -> int:
    """Submit ``args.app`` with its overrides; follow it unless ``--no-wait``."""
    jobs = client(args.address)
    with tempfile.TemporaryDirectory(prefix="pprun-submit-") as staging:
        env = runtime_env(args, Path(staging))
        job_id = jobs.submit_job(
            entrypoint=entrypoint(args.app, args.overrides),
            runtime_env=env,
            submission_id=args.job_id,
            metadata={"pprun_app": args.app},
        )
    print(f"pprun submit: job {job_id} submitted to {job_server_address(args.address)}", file=sys.stderr, flush=True)
    print(job_id, flush=True)
    if args.no_wait:
        return 0
    try:
        follow_logs(jobs, job_id)
    except KeyboardInterrupt:
        print(
            f"\npprun submit: stopped following; job {job_id} keeps running "
            f"(pprun submit stop {job_id} stops it)",
            file=sys.stderr,
        )
        return 130
    status = wait_final(jobs, job_id)
    _, line = _status_line(jobs, job_id)
    print(f"pprun submit: {line}", file=sys.stderr, flush=True)
    return EXIT_CODES.get(status, 1)


def cmd_status(args: argparse.Namespace) -> int:
    """Print the job's status (and message)."""
    _, line = _status_line(client(args.address), args.job_id)
    print(line)
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    """Print the job's logs so far, or follow them until it ends with ``--follow``."""
    jobs = client(args.address)
    if args.follow:
        follow_logs(jobs, args.job_id)
    else:
        sys.stdout.write(jobs.get_job_logs(args.job_id))
    sys.stdout.flush()
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    """Stop the job and wait (bounded) until it has stopped; exits with its final status."""
    jobs = client(args.address)
    jobs.stop_job(args.job_id)
    status = wait_final(jobs, args.job_id, STOP_WAIT_S)
    _, line = _status_line(jobs, args.job_id)
    print(line)
    if status not in TERMINAL:
        print(f"pprun submit stop: the job is still {status} after {STOP_WAIT_S:.0f}s", file=sys.stderr)
        return 1
    return EXIT_CODES[status]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``pprun submit`` arguments: a management command, or options then an app and its overrides."""
    address_help = "job server (dashboard) address, e.g. http://HEAD:8265; default: RAY_ADDRESS"
    if argv and argv[0] in MANAGE_COMMANDS:
        parser = argparse.ArgumentParser(prog=f"pprun submit {argv[0]}")
        parser.add_argument("job_id", metavar="JOB_ID")
        parser.add_argument("--address", help=address_help)
        if argv[0] == "logs":
            parser.add_argument("--follow", "-f", action="store_true", help="follow until the job ends")
        args = parser.parse_args(argv[1:])
        args.command = argv[0]
        return args
    apps = _apps()
    parser = argparse.ArgumentParser(
        prog="pprun submit",
        description="Run a pprun app as a Ray job: pprun submit [options] APP [overrides ...]; "
        "or pprun submit status|logs|stop JOB_ID.",
    )
    parser.add_argument("--address", help=address_help)
    parser.add_argument("--no-wait", action="store_true", help="print the job id and return at once")
    parser.add_argument("--job-id", help="the job's id (submission id); default: one Ray makes")
    parser.add_argument("--working-dir", help="directory carried to the job as its working directory (default: .)")
    parser.add_argument("--no-working-dir", action="store_true", help="carry no working directory")
    parser.add_argument(
        "--no-ship-pprun", dest="ship_pprun", action="store_false",
        help="use the pprun installed on the cluster instead of carrying this one",
    )
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME[=VALUE]",
        help="environment variable for the job (repeatable); PPRUN_* variables are passed anyway",
    )
    parser.add_argument("app", metavar="APP", help=f"the pprun app to run: {', '.join(apps)}")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="the app's Hydra overrides")
    args = parser.parse_args(argv)
    if args.app not in apps:
        parser.error(f"unknown app {args.app!r}: choose one of {', '.join(apps)} (or status, logs, stop)")
    args.command = "submit"
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``pprun submit``; exits with the status described in the module docstring."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    command = {"submit": cmd_submit, "status": cmd_status, "logs": cmd_logs, "stop": cmd_stop}[args.command]
    try:
        code = command(args)
    except (ValueError, RuntimeError) as e:  # RuntimeError: the job server's answer (unknown job, ...)
        print(f"pprun submit: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
