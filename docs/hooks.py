"""mkdocs hooks: the repository's own Markdown files become pages of the site (the README is its
home page), their links are rewritten to the site's pages, and the compatibility page is
generated from the published validation measurements (``validation/results/*.json``)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
# files outside docs/ -> their page on the site
PAGES = {
    "README.md": "index.md",
    "ARCHITECTURE.md": "architecture.md",
    "CHANGELOG.md": "changelog.md",
    "CONTRIBUTING.md": "contributing.md",
    "validation/README.md": "validation.md",
    "benchmarks/README.md": "benchmark-suite.md",
}
_LINK = re.compile(r"\]\((?!https?://|#|mailto:)([^)#\s]+)(#[^)\s]*)?\)")


def on_files(files: Files, config: Any) -> Files:
    for source, page in PAGES.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / source)))
    files.append(File.generated(config, "compatibility.md", content=_compatibility_page()))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    """Links to files of the repository become links to their pages (or stay as they are)."""
    source = Path(page.file.abs_src_path) if page.file.abs_src_path else ROOT / "docs" / page.file.src_uri

    def rewritten(match: re.Match[str]) -> str:
        target = (source.parent / match[1]).resolve()
        relative = target.relative_to(ROOT).as_posix() if target.is_relative_to(ROOT) else None
        if relative in PAGES:
            return f"]({PAGES[relative]}{match[2] or ''})"
        if relative is not None and relative.startswith("docs/"):
            return f"]({relative.removeprefix('docs/')}{match[2] or ''})"
        return match[0]

    return _LINK.sub(rewritten, markdown)


def _compatibility_page() -> str:
    spec = importlib.util.spec_from_file_location("validation_run", ROOT / "validation" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.compatibility_page(sorted((ROOT / "validation" / "results").glob("*.json")))
