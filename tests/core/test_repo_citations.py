"""No file in the repository cites a file outside it (issue 27): a reader of a clone has only the clone.

Every tracked text file is searched for references to the machine the project was written on
(``/work/...``), to folders beside the checkout (``../shared``), and to documents that are not in the
repository (``STYLE.md``, ``DESIGN.md``, ``FACTS.md``); every relative Markdown link must resolve
inside the repository.  Paths under ``/tmp`` are defaults for caches and outputs, not citations.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TEXT = {".py", ".md", ".toml", ".yaml", ".yml", ".sh", ".txt", ".cfg", ".ini", ".cu", ".h", ".cpp"}
OUTSIDE = re.compile(r"/work/|\.\./shared|\b(?:STYLE|DESIGN|FACTS)\.md\b|gpu-requests/|gpu-results/")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
#: What this test itself names in order to look for it.
SELF = Path(__file__).resolve()


def _tracked() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.splitlines() if Path(line).suffix in TEXT]


def test_no_tracked_file_cites_a_file_outside_the_repository() -> None:
    hits = []
    for path in _tracked():
        if path.resolve() == SELF or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if "site-packages/" in line and "/work/main/" in line:
                continue  # tools/bench_core.py strips these prefixes from profiler paths: no citation
            m = OUTSIDE.search(line)
            if m:
                hits.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)}")
    assert not hits, "\n".join(hits)


def test_relative_markdown_links_resolve_inside_the_repository() -> None:
    broken = []
    for path in _tracked():
        if path.suffix != ".md" or not path.is_file():
            continue
        for target in MD_LINK.findall(path.read_text(errors="replace")):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.exists() or ROOT not in resolved.parents and resolved != ROOT:
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "\n".join(broken)


#: A path into one of the repository's own folders, as prose and docstrings cite files (``passes/quant/recipe.py``).
REPO_PATH = re.compile(
    r"(?<![\w/.:-])((?:benchmarks|tools|tests|models|mograph|passes|plugins)/[\w./-]*\.(?:md|py|jsonl|json|sh|yaml|yml|cuh|cu))"
    r"(?![\w])")


def test_cited_repository_paths_exist() -> None:
    """A file cited by its path in the repository's folders is there (a moved file's old path is a citation of
    a file the clone does not have: README named ``mograph/passes/quant/recipe.py`` and ``tests/test_layering.py``)."""
    missing = []
    for path in _tracked():
        if path.resolve() == SELF or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for target in REPO_PATH.findall(line):
                if any(c in target for c in "*{<"):
                    continue  # a pattern, not a file
                if not (ROOT / target).exists() and not (path.parent / target).exists():
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {target}")
    assert not missing, "\n".join(missing)
