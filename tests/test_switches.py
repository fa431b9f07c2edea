"""Every ``PPRUN_*`` environment variable pprun reads is documented in ``docs/switches.md``, and
every debugging switch is registered in ``pprun.switches.SWITCHES`` (what the ``switch``
fixture flips)."""

from __future__ import annotations

import re
from pathlib import Path

from pprun.switches import SWITCHES

REPO = Path(__file__).resolve().parent.parent
NAME = re.compile(r"PPRUN_[A-Z0-9_]*[A-Z0-9]")


def test_every_variable_is_documented():
    doc = (REPO / "docs" / "switches.md").read_text()
    documented = set(NAME.findall(doc))
    used = {m for p in (REPO / "pprun").rglob("*.py") for m in NAME.findall(p.read_text())}
    used.discard("PPRUN_DISABLE")  # the prefix, named in docstrings
    assert used - documented == set(), "PPRUN_* variables read in pprun/ but missing from docs/switches.md"
    assert set(SWITCHES) <= documented


def test_every_switch_read_at_import_is_registered():
    read = {m for p in (REPO / "pprun").rglob("*.py")
            for m in re.findall(r'enabled_unless\("(PPRUN_[A-Z0-9_]+)"\)', p.read_text())}
    assert read == set(SWITCHES)
