"""The repository's documents stand on their own: links resolve inside it, design citations name real sections, the
generated reference pages are current, every page says who it is for, and no diary label is left in the tree."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest

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


def _render_docs():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "tools" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("page", ["cli.md", "configuration.md"])
def test_the_generated_reference_pages_are_what_the_code_renders(page):
    # A command's help or an AUTOSEL_* variable changed without the page: run python tools/render_docs.py.
    assert (ROOT / "docs" / page).read_text(encoding="utf-8") == _render_docs().PAGES[page]()


def test_the_configuration_page_lists_every_variable_config_reads():
    from autosel.config import VARIABLES

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert [name for name in VARIABLES if f"| `{name}` |" not in text] == []


def test_every_documentation_page_opens_with_who_it_is_for():
    # The pages were a log to read in order; each now says in its first lines which reader it serves.
    pages = [p for p in sorted((ROOT / "docs").glob("*.md"))]
    missing = [p.name for p in pages if "For: " not in "\n".join(p.read_text(encoding="utf-8").splitlines()[:8])]
    assert missing == []


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250


# Labels of the working log that nobody outside the repository can resolve: "stop 36", "stop-24", "call 38-4",
# "25-3's tune", "set27", "sets 13-15".
DIARY = re.compile(r"\bstops?[ -]?[0-9]+|\bcalls? [0-9]+-[0-9]+|\b[0-9]+-[0-9]+'s (?:tune|probe|run)\b|device calls?\b"
                   r"|\bset ?[0-9]+\b|\bsets [0-9]+", re.IGNORECASE)


def _read_for_labels(rel: str, path: Path) -> bool:
    """Whether the label test reads this file: code and pages of the package, tests, tools and dev/, the shipped
    DBs' page, results' pages and examples/ (the image's Dockerfile among them). Result JSON files are read by
    labels_in_result, which lets a recorded command keep its arguments."""
    if rel in ("README.md", "tuning_db/README.md"):
        return True
    if rel.startswith("results/"):
        return path.suffix == ".md"
    if rel.startswith("examples/"):
        return path.suffix in (".py", ".md", ".sh", ".toml") or path.name == "Dockerfile"
    return rel.startswith(("docs/", "autosel/", "tests/", "tools/", "dev/")) and path.suffix in (
        ".py", ".md", ".sh", ".c", ".toml")


def test_no_diary_label_in_docs_code_tests_tools_dev_results_or_examples():
    # docs/ held a 5,000-line dated log, and its labels were in 106 places of the code, tests and tools; the
    # shipped DBs' page, which the label test did not read, still cited "device call 37-2" and a deleted page.
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if not _read_for_labels(rel, path):
            continue
        if path.name == "test_docs.py":  # this file names the labels to find them
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            # The benchmarks page quotes each result file's command verbatim; a carried figure keeps the command
            # that made it, labels and all.
            if rel == "docs/BENCHMARKS.md" and line.startswith("- command: `"):
                continue
            # A label wrapped over two lines ("(call\n32-1)" in docs/KERNELS.md) is read with the next line's start.
            following = lines[number].strip().lstrip("#").split(" ", 1)[0] if number < len(lines) else ""
            if DIARY.search(line) or DIARY.search(f"{line.rstrip()} {following}"):
                found.append(f"{rel}:{number}: {line.strip()[:80]}")
    assert found == []


def test_the_diary_pattern_catches_each_kind_of_label():
    # "device calls 22-4 and 22-5" in autosel/ops/opaque.py passed the pattern that knew "call" alone; "stop-24",
    # "stops 32-34" and "25-3's tune" in the carried result files passed the pattern before this one.
    labels = ("Stop 36", "stop-24", "stops 32-34", "device call 13-3", "device calls 22-4 and 22-5",
              "calls 33-6 and 34-3", "Call 30-1's probe", "25-3's tune", "set27", "Set13", "held-out sets 2 and 3",
              "sets 13-15", "set 4")
    assert [t for t in labels if not DIARY.search(t)] == []
    names = ("offset 4", "the 4-token bucket", "recalls 3-4", "a 2-4 run", "stops at 4 warps",
             "the held-out set of 547c865", "upset 3")
    assert [t for t in names if DIARY.search(t)] == []


# A code span, in which a recorded command line keeps its arguments (`--shapes set28`).
CODE_SPAN = re.compile(r"`[^`]*`")


def labels_in_result(record: object, where: str = "") -> list[str]:
    """The diary labels in a result file's keys and strings, outside a "command" value and outside code spans: a
    carried figure keeps the command that made it verbatim, and the prose around it names the run by its commit."""
    if isinstance(record, dict):
        found = [f"{where}: key {key!r}" for key in record if DIARY.search(CODE_SPAN.sub("", key))]
        for key, value in record.items():
            if key != "command":
                found += labels_in_result(value, f"{where}.{key}")
        return found
    if isinstance(record, list):
        return [label for i, value in enumerate(record) for label in labels_in_result(value, f"{where}[{i}]")]
    match = DIARY.search(CODE_SPAN.sub("", record)) if isinstance(record, str) else None
    return [f"{where}: {match.group(0)!r} in {record[:80]!r}"] if match else []


def test_no_diary_label_in_result_files():
    # The carried result files quoted the diary verbatim and held about 150 labels ("call 27-3", "stop 26's plan",
    # "set11") that the label test, which read no JSON, did not see.
    found = []
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("results/") and path.suffix == ".json":
            found += [f"{rel}{label}" for label in labels_in_result(json.loads(path.read_text(encoding="utf-8")))]
    assert found == []


def test_a_result_file_may_keep_a_label_only_in_its_command_or_a_code_span():
    record = {"command": "tools/heldout_bench.py --shapes set28", "results": {
        "notes": ["the held-out shapes (`--shapes set28`) at ec517e4", "judged in call 38-4"],
        "rows": [["stop 36 / now", "1.02"]], "set27": 1}}
    assert labels_in_result(record) == [
        ".results: key 'set27'", ".results.notes[1]: 'call 38-4' in 'judged in call 38-4'",
        ".results.rows[0][0]: 'stop 36' in 'stop 36 / now'"]


# A figure: a number, or a range of two, with a unit of time, a ratio ("1.4x", not the "8 x 128" of a shape) or a
# percentage.
FIGURE = re.compile(r"(?<![\w.])\d+(?:[.,]\d+)*(?:-\d+(?:[.,]\d+)*)?(?:\s?(?:ms|µs|us|s)\b|x\b|%)")
# autosel's own settings, which the pages quote beside the constant that holds them and which no run measures: the
# rule's floors, cuts and host readings (autosel/policy.py, autosel/tuner.py), the CPU timer's block sizes
# (autosel/timing.py), the time budgets, busy timeout and lease bounds (autosel/config.py, autosel/db/), and the
# process-group timeout of the many-ranks tests (tests/test_distributed.py).
SETTINGS = {"6%", "10%", "5%", "3%", "1.2x", "1.25x", "1.6x", "3x", "1.3x", "1 ms", "50 ms", "2.5 ms", "30 s", "60 s",
            "120 s", "300 s", "600 s", "20 s"}
# Generated pages: the benchmarks page from result files (test_bench checks it), the CLI and configuration
# references from the code's help (checked above).
GENERATED = {"BENCHMARKS.md", "cli.md", "configuration.md"}


def _blocks(text: str) -> list[str]:
    """A page's paragraphs, a table read together with the paragraph that introduces it."""
    blocks: list[str] = []
    for block in re.split(r"\n[ \t]*\n", text):
        if block.lstrip().startswith("|") and blocks:
            blocks[-1] += "\n" + block
        else:
            blocks.append(block)
    return blocks


def unsourced_figures(text: str) -> list[str]:
    """The paragraphs that quote a measured figure but cite no result file (a path under results/)."""
    return [block for block in _blocks(text) if "results/" not in block
            and any(figure.replace("\u00a0", " ") not in SETTINGS for figure in FIGURE.findall(block))]


@pytest.mark.parametrize("page", ["README.md", *sorted(p.name for p in (ROOT / "docs").glob("*.md")
                                                         if p.name not in GENERATED)])
def test_every_measured_figure_cites_a_result_file(page):
    # TUNING and KERNELS quoted figures by commit, and the numbers were in a deleted diary, not in a file that
    # names the command, commit and platform; a figure now cites its result file in the same paragraph.
    path = ROOT / page if page == "README.md" else ROOT / "docs" / page
    found = [f"{block.strip()[:120]}... ({', '.join(FIGURE.findall(block))})"
             for block in unsourced_figures(path.read_text(encoding="utf-8"))]
    assert found == []


def test_the_figure_rule_tells_a_measurement_from_a_setting_and_a_shape():
    assert FIGURE.findall("0.3-0.5 us, 1.4x, 12%, 8 x 128, 2 x budget, 60 s, sm_90, 1.5s") == [
        "0.3-0.5 us", "1.4x", "12%", "60 s", "1.5s"]
    assert unsourced_figures("The floor is 6% (policy.py).\n\nIt ran 1.4x faster.") == ["It ran 1.4x faster."]
    assert unsourced_figures("It ran 1.4x faster ([x](../results/carried/a.json)).") == []
    assert unsourced_figures("Measured, results/a.json:\n\n| a | b |\n|---|---|\n| 1 | 2.5 us |") == []


def test_every_cited_result_file_exists_and_carries_its_provenance():
    # A page cited a result file by a name no file had; a carried file must say where its figures were copied from.
    from autosel.bench.results import read_result

    cited = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        cited |= set(re.findall(r"results/[\w./-]+\.json", page.read_text(encoding="utf-8")))
    assert cited
    missing = [c for c in sorted(cited) if not (ROOT / c).is_file()]
    assert missing == []
    for path in sorted((ROOT / "results" / "carried").glob("*.json")):
        assert read_result(path).get("carried"), path.name
