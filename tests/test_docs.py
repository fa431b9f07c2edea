"""Every repository path the docs cite exists.

The docs are README.md, docs/*.md, launchers/*.md, protos/*.md and the index of the measurement
records, benchmarks/README.md (the records themselves are kept as measured).  A cited path is

- a token inside backticks or a fenced code block (relative to the repository's root or to the
  doc's folder) that starts with one of the repository's top-level folders (``pprun/...``, ``scripts/...``, ``tests/...``, ``conf/...``, ...), or a
  top-level file (``pyproject.toml``, ``setup.py``); a pytest node id
  (``tests/test_x.py::test_y``) also needs its test (a ``def`` or ``class`` of that name in the
  file), a glob (``conf/*.yaml``) a match;
- the target of a Markdown link that is not a URL, resolved against the doc's folder, with its
  ``#anchor`` (when it has one) a heading of the target.

Paths under ``/tmp``, ``~`` or any other absolute path are the user's, not the repository's,
and placeholders are not checked: ``<...>`` and ``{...}``, and the path parts named in
:data:`PLACEHOLDER_NAMES` (declared: an upper-case name such as ``README.md`` or
``NVIDIA_H200.json`` is a file like any other).  A failure names the doc, the
line and the path.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def doc_files() -> list[Path]:
    """The Markdown files whose citations are checked."""
    docs = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]  # the records' index, not the records
    for folder in ("docs", "launchers", "protos"):
        docs += sorted((ROOT / folder).glob("*.md"))
    return [d for d in docs if d.is_file()]


# Top-level entries a cited path may start with: the tracked folders and files of the checkout.
TOP_DIRS = ("pprun", "scripts", "tests", "conf", "docs", "benchmarks", "launchers", "protos", ".ci")
TOP_FILES = ("README.md", "pyproject.toml", "setup.py", ".gitignore")
PATH_TOKEN = re.compile(
    r"(?<![\w./~-])((?:" + "|".join(re.escape(d) for d in TOP_DIRS) + r")/[\w./*+-]*(?:::[\w\[\]-]+)*"
    r"|(?:" + "|".join(re.escape(f) for f in TOP_FILES) + r")(?![\w/-]))"
)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
PLACEHOLDER_NAMES = ("NAME",)
"""Path parts that stand for a name the reader picks (``scripts/NAME``): the only upper-case
placeholders; every other upper-case part is checked."""
PLACEHOLDER = re.compile(r"[<>{}]|(?:^|/)(?:" + "|".join(PLACEHOLDER_NAMES) + r")(?:/|\.|$)")


def cited(doc: Path) -> Iterator[tuple[int, str, str]]:
    """Yield ``(line number, kind, citation)`` for every repository path the doc cites; kind is
    ``path`` (relative to the repository root) or ``link`` (relative to the doc's folder)."""
    in_fence = False
    for line_no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        texts = [line] if in_fence else [m.group(2) for m in CODE_SPAN.finditer(line)]
        for text in texts:
            for m in PATH_TOKEN.finditer(text):
                yield line_no, "path", m.group(1)
        if not in_fence:
            # Links, outside code spans (a link's syntax inside backticks is literal text).
            for m in LINK.finditer(CODE_SPAN.sub("", line)):
                yield line_no, "link", m.group(1)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks), with GitHub's ``-N``
    suffixes for repeated ones."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    in_fence = False
    for line in md.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if in_fence or not m:
            continue
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def problem(doc: Path, kind: str, citation: str) -> str | None:
    """Why a citation does not hold, or None when it does."""
    if kind == "link":
        if re.match(r"^[a-z][a-z0-9+.-]*:", citation) or citation.startswith("//"):
            return None  # a URL (http:, https:, mailto:, ...)
        target, _, anchor = citation.partition("#")
        path = (doc.parent / target).resolve() if target else doc
        if not path.exists():
            return "no such file or folder"
        if anchor and path.suffix == ".md" and anchor not in anchors(path):
            return f"{path.relative_to(ROOT)} has no heading with the anchor #{anchor}"
        return None
    path_text, _, node = citation.partition("::")
    path_text = re.sub(r":\d+$", "", path_text).rstrip(".,;:")
    if PLACEHOLDER.search(path_text):
        return None
    if "*" in path_text:
        matches = [*ROOT.glob(path_text), *doc.parent.glob(path_text)]
        return None if matches else "the pattern matches no file"
    # Root-relative, or relative to the doc's folder (protos/README.md names its own files).
    path = next((p for p in (ROOT / path_text, doc.parent / path_text) if p.exists()), None)
    if path is None:
        return "no such file or folder"
    if node:
        name = re.split(r"[\[:]", node, maxsplit=1)[0]
        source = path.read_text(encoding="utf-8")
        if not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b", source, re.MULTILINE):
            return f"{path_text} defines no test {name!r}"
    return None


def test_docs_cite_only_paths_that_exist():
    """Every cited path and link target exists; the failure lists doc:line: path (why)."""
    bad = []
    count = 0
    for doc in doc_files():
        for line_no, kind, citation in cited(doc):
            count += 1
            why = problem(doc, kind, citation)
            if why:
                bad.append(f"{doc.relative_to(ROOT)}:{line_no}: {citation} ({why})")
    assert count > 50, f"only {count} citations found: the extraction is broken"
    assert not bad, "docs cite paths that do not exist:\n" + "\n".join(bad)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("see `pprun/cli.py` and `tests/test_x.py::test_y`", ["pprun/cli.py", "tests/test_x.py::test_y"]),
        ("`python scripts/gpu_speed.py /tmp/llama1b --ab`", ["scripts/gpu_speed.py"]),
        ("`~/tests/x.py` and `/tmp/docs/y.md` and `my/pprun/z.py`", []),
        ("[the guide](docs/speech.md#speed) and [web](https://example.org/docs/a.md)",
         ["docs/speech.md#speed", "https://example.org/docs/a.md"]),
        ("`setup.py` maps `conf/*.yaml`", ["setup.py", "conf/*.yaml"]),
    ],
)
def test_extraction(tmp_path: Path, line: str, expected: list[str]):
    """What counts as a citation: repository paths in backticks and link targets, not paths
    under /tmp or ~ or inside another path."""
    doc = tmp_path / "x.md"
    doc.write_text(line + "\n")
    assert [c for _, _, c in cited(doc)] == expected


def test_a_missing_path_is_named_with_its_doc_and_line(tmp_path: Path):
    """The check fails on a path, node id, glob and anchor that do not exist, and passes on ones
    that do."""
    doc = tmp_path / "x.md"
    assert problem(doc, "path", "pprun/cli.py") is None
    assert problem(doc, "path", "pprun/no_such_module.py") == "no such file or folder"
    assert "defines no test" in problem(doc, "path", "tests/test_docs.py::test_no_such_test")
    assert problem(doc, "path", "tests/test_docs.py::test_extraction[x]") is None
    assert problem(doc, "path", "conf/*.nothing") == "the pattern matches no file"
    assert problem(doc, "path", "scripts/NAME") is None  # a declared placeholder
    assert problem(doc, "path", "scripts/<name>.py") is None
    # Upper-case names are files like any other: checked, and a missing one is named.
    assert problem(doc, "path", "launchers/README.md") is None
    assert problem(doc, "path", "launchers/READNE.md") == "no such file or folder"
    assert problem(doc, "path", "pprun/layers/moe_configs/NVIDIA_H100.json") == "no such file or folder"
    readme = ROOT / "README.md"
    assert problem(readme, "link", "docs/performance.md#method") is None
    assert "no heading" in problem(readme, "link", "docs/performance.md#no-such-heading")
    assert problem(readme, "link", "docs/no_such_doc.md") == "no such file or folder"
