"""MkDocs hooks: the Markdown pages stay readable in the repository, the site builds strictly.

- The home page is the README (``docs/index.md`` only says so): its ``docs/X.md`` links
  become ``X.md``.
- A link from a page to a file of the repository outside ``docs/`` (an example script) is
  fine on a code host but has no page on the site: it becomes its text in code style. A link
  to a file that does not exist is left alone, so that ``mkdocs build --strict`` reports it.
- Docstrings use Sphinx roles (``:class:`~aioloader.X```), which Markdown does not know:
  they become code spans showing the name (the last component after ``~``).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
_LINK = re.compile(r"(?<!!)\[([^\]\n]+)\]\(([^)\s#]+)(#[^)\s]*)?\)")
_ROLE = re.compile(r":(?:func|class|meth|attr|exc|mod|data|obj|doc|ref):<code>(~?)([^<]+)</code>")


def _outside_link(match: re.Match[str], page_dir: str, docs_dir: Path) -> str:
    text, target = match.group(1), match.group(2)
    if "://" in target or target.startswith(("mailto:", "/")):
        return match.group(0)
    path = (ROOT / posixpath.normpath(posixpath.join(page_dir, target))).resolve()
    if path.is_relative_to(docs_dir) or not path.exists() or not path.is_relative_to(ROOT):
        return match.group(0)
    shown = text if text.startswith("`") else f"`{text}`"
    return shown


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    docs_dir = Path(config["docs_dir"]).resolve()
    src = page.file.src_uri
    if src == "index.md":
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        readme = _LINK.sub(lambda m: _outside_link(m, "", docs_dir), readme)
        return re.sub(r"\]\(docs/", "](", readme)
    page_dir = posixpath.join("docs", posixpath.dirname(src))
    return _LINK.sub(lambda m: _outside_link(m, page_dir, docs_dir), markdown)


def _role(match: re.Match[str]) -> str:
    name = match.group(2)
    return f"<code>{name.rsplit('.', 1)[-1] if match.group(1) else name}</code>"


def on_page_content(html: str, page: Any, config: Any, files: Any) -> str:
    return _ROLE.sub(_role, html)
