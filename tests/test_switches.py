"""Every ``PPRUN_*`` environment variable pprun, its tests, scripts and launchers read is
documented in ``docs/switches.md``, and every debugging switch is registered in
``pprun.switches.SWITCHES`` (what the ``switch`` fixture flips)."""

from __future__ import annotations

import re
from pathlib import Path

from pprun.switches import SWITCHES

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"PPRUN_[A-Z0-9_]*[A-Z0-9]")
SCANNED = ("pprun", "tests", "scripts", "launchers")
"""Where a ``PPRUN_*`` variable may be read or set: the package, its tests, scripts, launchers."""


def _sources():
    for top in SCANNED:
        for path in sorted((REPO / top).rglob("*")):
            if path.suffix in (".py", ".sh") and path.is_file():
                yield path


def test_the_scan_sees_every_tree():
    """The checker itself: each scanned tree has sources, and a name used only in tests/ is seen."""
    seen = {p.relative_to(REPO).parts[0] for p in _sources()}
    assert seen == set(SCANNED)
    used = {m for p in _sources() for m in NAME.findall(p.read_text())}
    assert "PPRUN_RANDOM_FAULTS_SEED" in used


def test_every_variable_is_documented():
    doc = (REPO / "docs" / "switches.md").read_text()
    documented = set(NAME.findall(doc))
    used: dict[str, set[str]] = {}
    for path in _sources():
        for m in NAME.findall(path.read_text()):
            used.setdefault(m, set()).add(str(path.relative_to(REPO)))
    used.pop("PPRUN_DISABLE", None)  # the prefix, named in docstrings
    missing = {name: sorted(where) for name, where in used.items() if name not in documented}
    assert not missing, f"PPRUN_* variables used but missing from docs/switches.md: {missing}"
    assert set(SWITCHES) <= documented


def test_every_switch_read_at_import_is_registered():
    read = {m for p in (REPO / "pprun").rglob("*.py")
            for m in re.findall(r'enabled_unless\("(PPRUN_[A-Z0-9_]+)"\)', p.read_text())}
    assert read == set(SWITCHES)
