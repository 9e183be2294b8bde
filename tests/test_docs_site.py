"""The documentation site builds, with every warning an error (``mkdocs build
--strict``): a broken link, a missing page or image, an API reference to a name
that does not exist, or a snippet of a file that moved fails here.  The pages'
code blocks run in tests/test_doc_blocks.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # (a notice about MkDocs 2)
    assert out.returncode == 0, (f"mkdocs build --strict failed (pip install -e '.[docs]' installs it):\n"
                                 f"{out.stdout[-3000:]}{out.stderr[-5000:]}")
    site = tmp_path / "site"
    reference = (site / "reference" / "client" / "index.html").read_text()
    for verb in ("put", "get", "peek", "listen", "sample", "load_table"):  # the API, from the docstrings
        assert f'id="tensorshare.Client.{verb}"' in reference, verb
    assert (site / "protocol" / "index.html").exists() and (site / "changelog" / "index.html").exists()
    assert (site / "benchmarks" / "results" / "latest-large.png").exists()
