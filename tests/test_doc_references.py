"""What the source says about the repository is true: every document a docstring or comment
cites (`docs/design.md`, `docs/ray.md`, ...) exists at that path, so a reader who follows it
finds it."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a repository path to a document: words, slashes and dots ending in .md (bench.md, serve.md,
# serve-shared.md and serve-fresh.md are files the benchmark writes into its output folder, not
# documents of the repository)
CITED = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)\b")
WRITTEN_BY_THE_BENCH = {"bench.md", "serve.md", "serve-shared.md", "serve-fresh.md"}


def cited_documents(text: str) -> set[str]:
    return {m for m in CITED.findall(text) if m not in WRITTEN_BY_THE_BENCH}


def test_the_pattern_finds_citations():
    text = "(DESIGN.md, Pillar 1) see docs/ray.md and README.md; writes bench.md; files .txt/.md"
    assert cited_documents(text) == {"DESIGN.md", "docs/ray.md", "README.md"}


def test_every_document_the_source_cites_exists():
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    missing = {}
    for f in files:
        if f.name == Path(__file__).name:  # its own examples above
            continue
        for doc in cited_documents(f.read_text()):
            if not (ROOT / doc).is_file():
                missing.setdefault(doc, []).append(str(f.relative_to(ROOT)))
    assert not missing, f"cited documents that do not exist: {missing}"
