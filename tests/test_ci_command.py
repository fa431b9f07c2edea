"""CI runs the README's test command verbatim: the last line of ``.ci/run`` is the command in the
README's set-up section that runs the test suite, character for character."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readmes_test_command() -> None:
    """``.ci/run`` ends with the README's test command (the bash block that runs pytest)."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, flags=re.S)
    (test_command,) = [b.strip() for b in blocks if "python -m pytest" in b]
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip()]
    assert ci_lines[-1] == test_command
    # The environment it runs in is a fresh one, activated before the command.
    assert any(re.match(r"python3 -m venv ", line) for line in ci_lines)
    assert any(re.match(r"\. .*/bin/activate", line) for line in ci_lines)
