"""The repository's documents stand on their own: links resolve inside it, design citations name real sections."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", ROOT / "tuning_db" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _files() -> list[Path]:
    """The repository's files: git's, so a developer's untracked notes and scratch (out/, ignored) are not read;
    every file under the root where there is no git."""
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return [p for p in ROOT.rglob("*") if ".git" not in p.parts]
    return [ROOT / line for line in listed.splitlines() if (ROOT / line).is_file()]


SOURCES = [p for p in _files() if p.suffix in (".py", ".md", ".sh", ".toml") and p.name != "test_docs.py"]


def test_relative_links_resolve_inside_the_repository():
    # The README linked ../shared/DESIGN.md, a file outside the repository.
    broken = []
    for doc in DOCUMENTS:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = (doc.parent / target).resolve()
            if not path.exists() or ROOT.resolve() not in path.parents:
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_design_citations_name_docs_design_and_an_existing_section():
    # Comments cited "DESIGN.md section N" of a DESIGN.md that was not in the repository.
    sections = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8"), re.M))
    bad = []
    for path in SOURCES:
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in re.finditer(r"(\S*)DESIGN\.md(?: section (\d+))?", text):
            prefix, number = match.group(1), match.group(2)
            if not (prefix.endswith("docs/") or path.parent == ROOT / "docs"):
                bad.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
            elif number is not None and number not in sections:
                bad.append(f"{path.relative_to(ROOT)}: {match.group(0)} (no such section)")
    assert bad == []


def test_shipped_db_instructions_export_rather_than_copy_a_user_db():
    # tuning_db/README.md said to copy build.db into place, while autosel warns against shipping a copy of one.
    text = (ROOT / "tuning_db" / "README.md").read_text(encoding="utf-8")
    assert "autosel export --db build.db --out tuning_db/" in text
    assert "copy it here" not in text
