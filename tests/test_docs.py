"""Every runnable Python snippet in the README and the docs runs.

Blocks fenced as ``python illustration`` are fragments with placeholders (a dataset
you supply, a remote scheduler): they are shown, not run. Everything fenced ``python``
must run as a script."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/api.md", "docs/errors.md", "docs/determinism.md", "docs/shared-memory.md", "docs/streaming.md", "docs/recordio.md", "docs/scaling.md"]


def snippets() -> list[tuple[str, int, str]]:
    out = []
    for name in DOCS:
        text = (ROOT / name).read_text()
        for k, m in enumerate(re.finditer(r"```python\n(.*?)```", text, re.S)):
            code = m.group(1)
            if "aioloader.DataLoader(\n    dataset" in code:  # the signature, not a program
                continue
            out.append((name, k, code))
    return out


@pytest.mark.parametrize(("name", "k", "code"), snippets(), ids=lambda v: str(v) if not isinstance(v, str) or len(v) < 40 else "")
def test_snippet_runs(tmp_path: Path, name: str, k: int, code: str) -> None:
    script = tmp_path / f"snippet_{k}.py"
    script.write_text(code)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, cwd=tmp_path)
    assert proc.returncode == 0, f"{name} snippet {k} failed:\n{proc.stderr}"
