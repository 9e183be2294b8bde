"""MkDocs hooks: files that live outside docs/ published in the site, read where they are.

PROTOCOL.md and CHANGELOG.md stay at the repository's root (where a clone shows
them) and the benchmark's results where ``make bench`` writes them; the site
publishes each from there, so that no copy goes stale.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

# Site path -> repository path.
OUTSIDE = {"protocol.md": "PROTOCOL.md", "changelog.md": "CHANGELOG.md"}
RESULTS = "benchmarks/results"  # latest.md and its plots, published at the same path


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).parent
    published = dict(OUTSIDE)
    for path in sorted((root / RESULTS).glob("latest*")):
        if path.suffix in (".md", ".png") and path.name != "latest-goals.md":  # (goals: in benchmarks.md)
            published[f"{RESULTS}/{path.name}"] = f"{RESULTS}/{path.name}"
    for uri, path in published.items():
        files.append(File.generated(config, uri, abs_src_path=str(root / path)))
    return files
