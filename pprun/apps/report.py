"""``pprun report DIR``: one table (CSV and Markdown) and one plot (PNG) from a sweep's bench JSONs.

``pprun bench -m ...`` writes each job's result to ``<sweep dir>/<job number>/bench.json`` and,
when the sweep ends, renders this report into the sweep directory (the Hydra callback
:class:`pprun.apps.bench.SweepReport`); ``pprun report DIR`` renders it again from the JSONs
alone, e.g. after a job was re-run by hand or on a copy of the directory.

* **Swept settings** are the Hydra overrides that differ between the runs (each ``bench.json``
  records its job's overrides under ``"overrides"``).  A result without them (written by
  ``output_json=`` outside a sweep) contributes its configuration facts instead: the facts
  that differ between the runs become the columns.  A ``batch_sizes=[...]`` result counts as
  one run per row (``<file>/b<batch>``), its batch as the row's ``num_prompts``.
* **Table** (``bench_table.csv``, ``bench_table.md``): one row per run, in job order: the run's
  folder, the swept settings, the configuration facts and pprun's metrics (and the peer's
  throughput and the ratio when the run timed one).
* **Plot** (``bench_throughput.png``, 800 x 500 pixels): output throughput in tokens/s against
  one swept setting (the last numeric one, else the last one), one line per combination of the
  other swept settings.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TABLE_CSV = "bench_table.csv"
TABLE_MD = "bench_table.md"
PLOT_PNG = "bench_throughput.png"
"""File names of the report, written into the sweep directory."""

PLOT_SIZE_IN = (8.0, 5.0)
PLOT_DPI = 100
"""The plot's size in inches and its resolution: 800 x 500 pixels."""

FACT_KEYS = ("executor", "pp", "runner", "batch", "steps_in_flight", "device", "dtype", "cudagraph_mode")
"""Configuration facts of a bench result (its ``"config"`` object) shown in the table."""

WORKLOAD_KEYS = ("num_prompts", "input_len", "output_len")
"""Workload facts of a bench result (its ``"workload"`` object) shown in the table."""

METRIC_KEYS = (
    "output_tokens_per_s",
    "total_tokens_per_s",
    "requests_per_s",
    "decode_tokens_per_s",
    "ttft_ms_p50",
    "tpot_ms_p50",
    "elapsed_s",
)
"""pprun's metrics (its ``"pprun"`` object) shown in the table."""

PLOT_METRIC = "output_tokens_per_s"
"""The plotted metric: generated tokens per second over the whole timed run."""

AXIS_UNITS = {
    "max_num_seqs": "requests",
    "max_num_batched_tokens": "tokens",
    "num_prompts": "requests",
    "input_len": "tokens",
    "output_len": "tokens",
    "microbatches": "batches in flight",
    "pipeline_parallel_size": "stages",
    "pp": "stages",
    "batch": "requests",
    "block_size": "tokens",
}
"""Unit of a swept setting on the plot's x axis, by its last dotted name part."""


@dataclass
class BenchRun:
    """One bench result found under the report's directory."""

    name: str
    """The result's folder relative to the report's directory (a sweep job's number), or its file stem."""
    result: dict[str, Any]
    """The JSON object ``pprun bench`` printed."""
    settings: dict[str, str] = field(default_factory=dict)
    """Swept setting -> this run's value (filled by :func:`swept_settings`)."""


def find_runs(directory: Path) -> list[BenchRun]:
    """Every bench result (a JSON object with ``"pprun"`` and ``"config"`` objects) in ``directory``
    and its sub-folders, in job order (numeric folder names sort as numbers)."""
    if not directory.is_dir():
        raise ValueError(f"report directory {str(directory)!r} is not a directory")
    runs = []
    for path in directory.rglob("*.json"):
        try:
            obj = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        rel = path.parent.relative_to(directory)
        name = str(rel) if str(rel) != "." else path.stem
        if path.name != "bench.json" and str(rel) != ".":
            name = f"{rel}/{path.stem}"
        runs.extend(BenchRun(f"{name}{suffix}", result) for suffix, result in _results_in(obj))
    if not runs:
        raise ValueError(
            f"no bench results in {str(directory)!r}: expected JSON files written by `pprun bench` "
            "(a sweep writes <job number>/bench.json)"
        )
    runs.sort(key=lambda r: _natural_key(r.name))
    return runs


def _is_result(obj: Any) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("pprun"), dict) and isinstance(obj.get("config"), dict)


def _results_in(obj: Any) -> list[tuple[str, dict[str, Any]]]:
    """The bench results one JSON file holds, each with a suffix for its run's name: the object
    itself, or the ``rows`` of a ``batch_sizes`` run (``/b<batch>`` each; the row's batch is
    recorded as its ``num_prompts`` override, the setting that differs between its rows)."""
    if _is_result(obj):
        return [("", obj)]
    rows = obj.get("rows") if isinstance(obj, dict) else None
    if not isinstance(rows, list):
        return []
    out = []
    for row in rows:
        if not _is_result(row):
            continue
        batch = row["config"].get("batch")
        row = dict(row)
        overrides = row.get("overrides")
        if isinstance(overrides, dict):
            overrides = {k: v for k, v in overrides.items() if k not in ("batch_sizes", "peer_batch_sizes")}
            row["overrides"] = {**overrides, "num_prompts": str(batch)}
        out.append((f"/b{batch}", row))
    return out


def _natural_key(name: str) -> list[tuple[int, Any]]:
    parts = name.replace("\\", "/").split("/")
    return [(0, int(p)) if p.isdigit() else (1, p) for p in parts]


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | dict):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def swept_settings(runs: list[BenchRun]) -> list[str]:
    """The settings that differ between ``runs`` (in first-seen order), each run's value filled in
    ``run.settings``.  Recorded overrides are used where present; facts otherwise (see module doc)."""
    candidates: dict[str, None] = {}
    values: list[dict[str, str]] = []
    for run in runs:
        overrides = run.result.get("overrides")
        if isinstance(overrides, dict):
            own = {str(k): _text(v) for k, v in overrides.items()}
        else:
            config, workload = run.result["config"], run.result.get("workload") or {}
            own = {k: _text(config.get(k)) for k in FACT_KEYS}
            own.update({k: _text(workload.get(k)) for k in WORKLOAD_KEYS})
        values.append(own)
        candidates.update(dict.fromkeys(own))
    swept = [k for k in candidates if len({v.get(k, "") for v in values}) > 1]
    for run, own in zip(runs, values):
        run.settings = {k: own.get(k, "") for k in swept}
    return swept


def table_rows(runs: list[BenchRun], swept: list[str]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the report's table (one row per run; see the module docstring)."""
    with_peer = any(isinstance(r.result.get("peer"), dict) for r in runs)
    header = ["run", *swept, *FACT_KEYS, *WORKLOAD_KEYS, *METRIC_KEYS]
    if with_peer:
        header += ["peer_output_tokens_per_s", "ratio", "spread"]
    rows = []
    for run in runs:
        config, metrics = run.result["config"], run.result["pprun"]
        workload = run.result.get("workload") or {}
        row = [run.name, *(run.settings[k] for k in swept)]
        row += [_text(config.get(k)) for k in FACT_KEYS]
        row += [_text(workload.get(k)) for k in WORKLOAD_KEYS]
        row += [_text(metrics.get(k)) for k in METRIC_KEYS]
        if with_peer:
            peer = run.result.get("peer") or {}
            row += [_text(peer.get("output_tokens_per_s")), _text(run.result.get("ratio")), spread_text(metrics, peer)]
        rows.append(row)
    return header, rows


def spread_text(ours: dict, peer: dict) -> str:
    """The two engines' spread over repeated passes (``pprun / peer``, each max minus min over
    the median), ``UNSTABLE`` appended where a row stayed past the limit after its second timing."""
    spreads = [ours.get("spread"), peer.get("spread")]
    if all(s is None for s in spreads):
        return ""
    text = " / ".join("" if s is None else f"{100 * s:.1f}%" for s in spreads)
    return text + (" UNSTABLE" if ours.get("unstable") or peer.get("unstable") else "")


def to_csv(header: list[str], rows: list[list[str]]) -> str:
    """The table as CSV text."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return out.getvalue()


def to_markdown(header: list[str], rows: list[list[str]], title: str) -> str:
    """The table as a Markdown document with a title line."""

    def cells(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"

    lines = [f"# {title}", "", cells(header), "| " + " | ".join("---" for _ in header) + " |"]
    lines += [cells(row) for row in rows]
    return "\n".join(lines) + "\n"


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def plot_axis(swept: list[str], runs: list[BenchRun]) -> str | None:
    """The swept setting on the x axis: the last one whose every value is a number, else the last one
    (None when nothing was swept)."""
    numeric = [k for k in swept if all(_number(r.settings[k]) is not None for r in runs)]
    if numeric:
        return numeric[-1]
    return swept[-1] if swept else None


def axis_label(key: str) -> str:
    """``key`` with its unit, e.g. ``scheduler.max_num_seqs (requests)``."""
    unit = AXIS_UNITS.get(key.rsplit(".", 1)[-1])
    return f"{key} ({unit})" if unit else key


def render_plot(runs: list[BenchRun], swept: list[str], path: Path, title: str) -> None:
    """Throughput against the x-axis setting, one line per combination of the other swept settings,
    written as a PNG of :data:`PLOT_SIZE_IN` x :data:`PLOT_DPI`."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    x_key = plot_axis(swept, runs)
    others = [k for k in swept if k != x_key]
    numeric_x = x_key is not None and all(_number(r.settings[x_key]) is not None for r in runs)
    categories = list(dict.fromkeys(r.settings[x_key] for r in runs)) if x_key and not numeric_x else []
    lines: dict[str, list[tuple[float, float]]] = {}
    for i, run in enumerate(runs):
        y = run.result["pprun"].get(PLOT_METRIC)
        if y is None:
            continue
        if x_key is None:
            x = float(i)
        elif numeric_x:
            x = _number(run.settings[x_key])
        else:
            x = float(categories.index(run.settings[x_key]))
        label = ", ".join(f"{k}={run.settings[k]}" for k in others) or "pprun"
        lines.setdefault(label, []).append((x, float(y)))
    fig, ax = plt.subplots(figsize=PLOT_SIZE_IN, dpi=PLOT_DPI)
    try:
        for label, points in lines.items():
            points.sort()
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        xs = sorted({p[0] for points in lines.values() for p in points})
        if categories:
            ax.set_xticks(range(len(categories)), categories)
        elif numeric_x and len(xs) <= 12:
            ax.set_xticks(xs, [f"{x:g}" for x in xs])  # the swept values themselves, not a scale
        elif x_key is None:
            ax.set_xticks(range(len(runs)), [r.name for r in runs])
        ax.set_xlabel(axis_label(x_key) if x_key else "run")
        ax.set_ylabel("output throughput (tokens/s)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
        if lines:
            ax.legend(fontsize="small")
        fig.savefig(path, dpi=PLOT_DPI)  # no tight bbox: the size stays PLOT_SIZE_IN x PLOT_DPI
    finally:
        plt.close(fig)


def render_report(directory: str | Path) -> dict[str, Path]:
    """Write the table (CSV, Markdown) and the plot for the bench results under ``directory``;
    returns their paths by kind (``csv``, ``markdown``, ``png``)."""
    directory = Path(directory).expanduser()
    runs = find_runs(directory)
    swept = swept_settings(runs)
    header, rows = table_rows(runs, swept)
    title = f"pprun bench: {len(runs)} run{'s' if len(runs) != 1 else ''} in {directory.name}"
    paths = {"csv": directory / TABLE_CSV, "markdown": directory / TABLE_MD, "png": directory / PLOT_PNG}
    paths["csv"].write_text(to_csv(header, rows))
    paths["markdown"].write_text(to_markdown(header, rows, title))
    render_plot(runs, swept, paths["png"], title)
    logger.info("report: %d runs (swept: %s) -> %s", len(runs), ", ".join(swept) or "nothing", directory)
    return paths


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``pprun report DIR``: render the report of the bench results under DIR."""
    parser = argparse.ArgumentParser(
        prog="pprun report",
        description="Render a table (CSV, Markdown) and a throughput plot (PNG) from the bench JSONs "
        "under DIR (a `pprun bench -m` sweep directory), into DIR.",
    )
    parser.add_argument("directory", metavar="DIR", help="sweep directory holding <job>/bench.json files")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        paths = render_report(args.directory)
    except ValueError as e:
        print(f"pprun report: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    for path in paths.values():
        print(path)


if __name__ == "__main__":
    main()
