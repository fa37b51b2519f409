"""Every runnable Python snippet in the README and the docs runs.

Blocks fenced as ``{.python .illustration}`` are fragments with placeholders (a dataset
you supply, a remote scheduler): they are shown, not run. Everything fenced ``python``
must run as a script. Every page under docs/ is covered, and every page is in the site's
navigation (mkdocs.yml), so a new page can be neither forgotten by this test nor left
off the site.

A snippet that imports torch is marked like the torch tests (see ``tests/conftest.py``):
it skips where torch is not installed, except on the Python CI pins torch for. The
snippets of :data:`TYPED_PAGES` must also pass ``mypy --strict``: they are the ones
written to be copied into typed code."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS_DIR = ROOT / "docs"
PAGES = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in DOCS_DIR.rglob("*.md"))]
TYPED_PAGES = {"docs/api.md", "docs/migrating-from-torch.md", "docs/migrating-from-gluon.md"}
_FENCE = re.compile(r"```python\n(.*?)```", re.S)
_IMPORTS_TORCH = re.compile(r"^\s*(import torch|from torch[ .])", re.M)


def snippets() -> list[tuple[str, int, str]]:
    out = []
    for name in PAGES:
        text = (ROOT / name).read_text()
        for k, m in enumerate(_FENCE.finditer(text)):
            code = m.group(1)
            if "aioloader.DataLoader(\n    dataset" in code:  # the signature, not a program
                continue
            out.append((name, k, code))
    return out


def _params() -> list[Any]:
    return [
        pytest.param(name, k, code, marks=[pytest.mark.torch] if _IMPORTS_TORCH.search(code) else [])
        for name, k, code in snippets()
    ]


@pytest.mark.parametrize(
    ("name", "k", "code"), _params(), ids=lambda v: str(v) if not isinstance(v, str) or len(v) < 40 else ""
)
def test_snippet_runs(tmp_path: Path, name: str, k: int, code: str) -> None:
    script = tmp_path / f"snippet_{k}.py"
    script.write_text(code)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path
    )
    assert proc.returncode == 0, f"{name} snippet {k} failed:\n{proc.stderr}"


@pytest.mark.slow  # mypy reads torch's sources: about 20 s
def test_typed_pages_snippets_pass_mypy_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy comes with the dev extra")
    files = []
    for name, k, code in snippets():
        if name in TYPED_PAGES:
            path = tmp_path / f"{Path(name).stem.replace('-', '_')}_{k}.py"
            path.write_text(code)
            files.append(str(path))
    assert files
    config = tmp_path / "mypy.ini"
    config.write_text(f"[mypy]\nstrict = True\nmypy_path = {ROOT}\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(config),
            "--cache-dir",
            str(tmp_path / "cache"),
            *files,
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_page_is_in_the_site_navigation() -> None:
    nav = set(re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    pages = {p.relative_to(DOCS_DIR).as_posix() for p in DOCS_DIR.rglob("*.md")}
    assert pages - nav == set(), "pages missing from the nav in mkdocs.yml"
    assert nav - pages == set(), "mkdocs.yml names pages that do not exist"
