"""``pprun bench -m``: a sweep ends in a table (CSV, Markdown) and a plot; ``pprun report`` renders them again.

One real sweep on the demo model (two parallel layouts x two batch sizes, tiny workload, no
peer), run as the command a user types, in a subprocess so Hydra's global state stays out of
the test process.
"""

from __future__ import annotations

import csv
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pprun.apps import report

REPO_ROOT = Path(__file__).resolve().parent.parent
SWEEP_TIMEOUT_S = 300


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the signature)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory, demo_model_dir) -> Path:
    """A finished sweep: parallel=single,pp2_mp x scheduler.max_num_seqs=1,2 on the demo model."""
    out = tmp_path_factory.mktemp("sweep") / "sweep"
    cmd = [
        sys.executable, "-m", "pprun", "bench", "-m",
        "parallel=single,pp2_mp", "scheduler.max_num_seqs=1,2",
        "num_prompts=2", "input_len=8", "output_len=3", "peer=none",
        "cache.cpu_kv_cache_bytes=16777216", "model.max_model_len=64",
        f"hydra.sweep.dir={out}",
    ]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def test_sweep_ends_in_table_and_plot(sweep_dir):
    """One row per run with that run's settings, facts and metrics; a PNG of the documented size."""
    jsons = {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("*/bench.json")}
    assert sorted(jsons) == ["0", "1", "2", "3"]
    rows = _read_csv(sweep_dir / report.TABLE_CSV)
    assert [r["run"] for r in rows] == ["0", "1", "2", "3"]
    seen = set()
    for row in rows:
        result = jsons[row["run"]]
        # The row's swept values are the job's own overrides, and its facts follow from them.
        assert row["parallel"] == result["overrides"]["parallel"]
        assert row["scheduler.max_num_seqs"] == result["overrides"]["scheduler.max_num_seqs"]
        seen.add((row["parallel"], row["scheduler.max_num_seqs"]))
        assert row["pp"] == ("1" if row["parallel"] == "single" else "2")
        assert row["executor"].split()[0] == ("uni" if row["parallel"] == "single" else "mp")
        assert row["batch"] == row["scheduler.max_num_seqs"]
        assert float(row["output_tokens_per_s"]) == result["pprun"]["output_tokens_per_s"] > 0
        assert int(row["num_prompts"]) == 2 and int(row["output_len"]) == 3
        # Constant overrides (peer=none, ...) are not swept settings, and no peer columns appear.
        assert "peer" not in row and "ratio" not in row
    assert seen == {("single", "1"), ("single", "2"), ("pp2_mp", "1"), ("pp2_mp", "2")}
    md = (sweep_dir / report.TABLE_MD).read_text().splitlines()
    table = [line for line in md if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # header, rule, one line per run
    assert table[0].split(" | ")[1:3] == ["parallel", "scheduler.max_num_seqs"]
    width, height = _png_size(sweep_dir / report.PLOT_PNG)
    assert (width, height) == (report.PLOT_SIZE_IN[0] * report.PLOT_DPI, report.PLOT_SIZE_IN[1] * report.PLOT_DPI)


def test_report_reproduces_the_sweep_report(sweep_dir, tmp_path):
    """``pprun report DIR`` on a copy of the JSONs alone gives the same table and the same picture."""
    from PIL import Image

    copy = tmp_path / "copy"
    for path in sweep_dir.glob("*/bench.json"):
        (copy / path.parent.name).mkdir(parents=True)
        (copy / path.parent.name / "bench.json").write_text(path.read_text())
    proc = subprocess.run(
        [sys.executable, "-m", "pprun", "report", str(copy)], env=_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (copy / report.TABLE_CSV).read_text() == (sweep_dir / report.TABLE_CSV).read_text()
    # The title names the directory; the rest of the Markdown is the same.
    assert (copy / report.TABLE_MD).read_text().splitlines()[1:] == (
        sweep_dir / report.TABLE_MD
    ).read_text().splitlines()[1:]
    assert _png_size(copy / report.PLOT_PNG) == _png_size(sweep_dir / report.PLOT_PNG)
    # The plot's title names the directory: under the sweep's own name, the same pixels.
    renamed = tmp_path / sweep_dir.name
    copy.rename(renamed)
    report.render_report(renamed)
    with Image.open(renamed / report.PLOT_PNG) as a, Image.open(sweep_dir / report.PLOT_PNG) as b:
        assert a.size == b.size and a.tobytes() == b.tobytes()


def test_report_errors_name_the_directory(tmp_path):
    """A directory without bench results is a clear error (exit 2), not an empty report."""
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "other.json").write_text('{"not": "a bench result"}')
    proc = subprocess.run(
        [sys.executable, "-m", "pprun", "report", str(tmp_path)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "no bench results" in proc.stderr and str(tmp_path) in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "pprun", "report", str(tmp_path / "missing")],
        env=_env(), capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2 and "is not a directory" in proc.stderr


def test_facts_stand_in_for_missing_overrides(tmp_path):
    """Results without recorded overrides (``output_json=`` outside a sweep) are told apart by their facts."""
    for name, batch, tps in (("a", 1, 10.0), ("b", 4, 30.0)):
        result = {
            "workload": {"num_prompts": 8, "input_len": 16, "output_len": 4},
            "config": {"executor": "uni", "pp": 1, "batch": batch},
            "pprun": {"output_tokens_per_s": tps},
            "peer": None,
            "ratio": None,
        }
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    paths = report.render_report(tmp_path)
    rows = _read_csv(paths["csv"])
    assert [(r["run"], r["batch"], r["output_tokens_per_s"]) for r in rows] == [("a", "1", "10"), ("b", "4", "30")]
    assert list(rows[0])[1] == "batch"  # the one fact that differs is the swept setting
    assert _png_size(paths["png"]) == (800, 500)


def test_a_batch_sizes_result_reports_one_run_per_row(tmp_path):
    """``pprun bench batch_sizes=[...]`` writes one object with ``rows``: each row is a run, told
    apart by its batch (recorded as its ``num_prompts``)."""
    rows = [
        {
            "workload": {"num_prompts": batch, "input_len": 16, "output_len": 4},
            "config": {"executor": "uni", "pp": 1, "batch": batch, "max_num_seqs": 4},
            "pprun": {"output_tokens_per_s": tps},
            "peer": None,
            "ratio": None,
            "overrides": {"batch_sizes": "[1,4]", "input_len": "16"},
        }
        for batch, tps in ((1, 10.0), (4, 30.0))
    ]
    (tmp_path / "sweep.json").write_text(json.dumps({"batch_sizes": [1, 4], "rows": rows, "summary": []}))
    paths = report.render_report(tmp_path)
    got = _read_csv(paths["csv"])
    assert [(r["run"], r["num_prompts"], r["output_tokens_per_s"]) for r in got] == [
        ("sweep/b1", "1", "10"), ("sweep/b4", "4", "30"),
    ]  # fmt: skip
    assert list(got[0])[1] == "num_prompts"  # the one setting that differs between the rows
