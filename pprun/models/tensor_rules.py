"""Name rules for checkpoint tensors a model declares it never reads (see
:mod:`pprun.models.checkpoint`): a plain value a model module can declare without importing the
checkpoint reader."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class IgnoreRule:
    """Checkpoint tensors a model never reads, by name, with why (see the module docstring)."""

    pattern: str
    """A regular expression a tensor's name (as the model names it) must match in full; its
    first group, if any, is a layer index compared with :attr:`min_index`."""
    reason: str
    """Why the model does not read these tensors (shown in logs and docs)."""
    min_index: int | None = None
    """Only layer indices (the pattern's first group) from this one up match; None: any."""

    def matches(self, name: str) -> bool:
        """Whether ``name`` is one of the tensors this rule ignores."""
        m = re.fullmatch(self.pattern, name)
        if m is None:
            return False
        return self.min_index is None or int(m.group(1)) >= self.min_index
