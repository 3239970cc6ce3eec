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
