"""The Hydra apps behind ``pprun generate`` and ``pprun bench``, and the plumbing they share.

Each app module has a ``run(cfg)`` that does the work on a typed app config (callable from Python
and tests without Hydra) and a ``main()`` that reads ``sys.argv`` as Hydra overrides against the
YAML in ``conf/`` (see ``pprun.config.default_conf_dir``). ``pprun.cli`` dispatches the subcommands to those ``main()`` functions.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("pprun.apps.generate", "complete prompts (arguments or a JSONL file) and print a summary"),
    "bench": ("pprun.apps.bench", "offline throughput/latency as JSON, against a peer: transformers (peer=hf) or vLLM (peer=vllm)"),
    "serve": ("pprun.apps.serve", "serve the model over gRPC (pprun.v1, KServe v2 / Triton), loopback by default"),
    "submit": ("pprun.apps.submit", "run an app as a job on a Ray cluster (Ray Jobs); status, logs, stop"),
    "transcribe": ("pprun.apps.transcribe", "transcribe audio files with a speech model (Whisper); text per file, JSONL"),
    "report": ("pprun.apps.report", "table (CSV, Markdown) and throughput plot (PNG) of a bench sweep's JSONs"),
}
"""``pprun`` subcommand -> (module with a ``main()``, one-line description): what ``pprun.cli``
dispatches and ``pprun submit`` runs on a cluster."""


def run_hydra_app(config_name: str, task: Callable[[Any], None]) -> None:
    """Compose ``conf/<config_name>.yaml`` with the overrides in ``sys.argv[1:]`` and call
    ``task(app_config)`` once, or once per job under ``-m`` (multirun).

    ``task`` gets the typed app dataclass (``GenerateAppConfig`` / ``BenchAppConfig``). A
    ``ValueError`` from it (bad user input) is printed as one line naming the app, and the process
    exits with status 2; anything else keeps Hydra's report (exit status 1).
    """
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from pprun.config.config import default_conf_dir, register_configs

    register_configs()
    app_name = f"pprun {config_name}"

    def hydra_task(cfg: DictConfig) -> None:
        app_cfg = OmegaConf.to_object(cfg)
        logging.getLogger("pprun").setLevel(str(app_cfg.log_level).upper())
        try:
            task(app_cfg)
        except ValueError as e:
            print(f"{app_name}: error: {e}", file=sys.stderr)
            # SystemExit is not an Exception, so Hydra lets it through without a traceback.
            raise SystemExit(2) from None

    # Hydra names the job after the module defining the task function; keep the app's name.
    hydra_task.__module__ = f"pprun.apps.{config_name}"
    hydra.main(config_path=str(default_conf_dir()), config_name=config_name, version_base="1.3")(hydra_task)()


def in_multirun() -> bool:
    """True inside a job of a Hydra sweep (``-m``)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except ImportError:
        return False


def job_output_path(path: str | None) -> Path | None:
    """Where to write a user-named output file.

    In a sweep every job would overwrite the same relative path, so there a relative path is put
    in the job's own sweep folder (``hydra.sweep.dir/<job number>/``); absolute paths, and any
    path outside a sweep, are used as given.
    """
    if path is None:
        return None
    out = Path(path).expanduser()
    if not out.is_absolute() and in_multirun():
        from hydra.core.hydra_config import HydraConfig

        out = Path(HydraConfig.get().runtime.output_dir) / out
    return out


def job_output_dir() -> Path | None:
    """The current sweep job's folder, or None outside a sweep."""
    if not in_multirun():
        return None
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def iter_jsonl(path: str, field: str = "input_file") -> Iterator[tuple[str, dict]]:
    """Yield ``(where, object)`` for each non-blank line of a JSONL file, ``where`` naming the
    line for error messages; a missing file, bad JSON or a non-object line is a ValueError."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"{field}={path!r} is not a file")
    with open(file, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{field} line {line_no}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: must be a JSON object, got {type(obj).__name__}")
            yield where, obj
