"""The documentation builds with every link and anchor resolved (MkDocs, strict), and the README stays short and
links only to what exists."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_docs_build_strictly(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "how-it-works" / "index.html").exists()


def _anchor(title: str) -> str:
    """MkDocs' (Python-Markdown toc) anchor of a heading."""
    return re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title.strip().lower()))


def test_readme_is_short_and_its_links_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for target in re.findall(r"\]\(([^)#\s]+)(?:#([^)\s]+))?\)", readme):
        path, anchor = target
        if path.startswith(("http://", "https://")):
            continue
        assert (ROOT / path).exists(), path
        if anchor:
            headings = re.findall(r"(?m)^#+ (.+)$", (ROOT / path).read_text())
            assert anchor in {_anchor(h) for h in headings}, (path, anchor)
