"""What the user docs name exists: every file path (src/msmon/..., a package-relative
`seams/spec.py`, benchmarks/..., tests/..., examples/..., tools/...) and every local link with
its #anchor. docs/architecture.md is left out: it names files a reader would add (a new sink, verb
or framework folder) as examples, and has its own check."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "src" / "msmon"
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "architecture.md") + [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
]
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
_FIRST = "|".join(["src/msmon", "msmon", "benchmarks", "tests", "examples", "tools", *SUBPACKAGES])
# a path: one of those first folders, then folders and a file name with its extension
PATH = re.compile(rf"(?<![\w/.-])((?:{_FIRST})/[\w./-]*?\w\.(?:py|cpp|sh|json|md|toml))(?![\w/-])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_BLOCK = re.compile(r"^```.*?^```", re.M | re.S)


def named_paths(text: str) -> list[str]:
    """The file paths a doc's text names (placeholders such as `{category}` or `*` left out)."""
    return [p for p in PATH.findall(text) if not re.search(r"[*{}<>]", p)]


def missing_paths(doc: Path) -> list[str]:
    """The paths `doc` names that exist nowhere: not from the repository root, src/, the package
    (`seams/spec.py`) nor the doc's own folder (`gpu/accelerator_table.py` in benchmarks/README.md)."""
    bases = (ROOT, ROOT / "src", PACKAGE, doc.parent)
    return [p for p in named_paths(doc.read_text()) if not any((base / p).exists() for base in bases)]


def heading_anchors(markdown: str) -> set[str]:
    """The #anchors GitHub makes of a page's headings: lower case, punctuation but - and _ dropped,
    spaces as hyphens; a repeated heading gets -1, -2, ..."""
    anchors: set[str] = set()
    for line in CODE_BLOCK.sub("", markdown).splitlines():
        if not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def broken_links(doc: Path) -> list[str]:
    """Local links of `doc` whose file, or whose #anchor in that file, does not exist."""
    broken = []
    for target in LINK.findall(CODE_BLOCK.sub("", doc.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(target)
    return broken


def test_every_file_path_the_user_docs_name_exists():
    missing = {doc.relative_to(ROOT).as_posix(): missing_paths(doc) for doc in DOCS}
    assert not {doc: paths for doc, paths in missing.items() if paths}, missing


def test_every_local_link_of_the_user_docs_reaches_its_file_and_heading():
    broken = {doc.relative_to(ROOT).as_posix(): broken_links(doc) for doc in DOCS}
    assert not {doc: links for doc, links in broken.items() if links}, broken


def test_the_readme_performance_section_links_to_the_method_of_docs_performance():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Performance") : readme.index("## Documentation")]
    assert "docs/performance.md#method" in section
    assert "method" in heading_anchors((ROOT / "docs" / "performance.md").read_text())


def test_the_path_check_finds_the_paths_a_doc_names_and_reports_the_ones_that_do_not_exist(tmp_path):
    doc = tmp_path / "sample.md"
    doc.write_text(
        "See `src/msmon/config/schema.py`, seams/spec.py and benchmarks/overhead.py; not "
        "`src/msmon/nowhere.py` nor benchmarks/gone_cost.py; `{category}_{first}-{last}.csv` and "
        "monitor_output/report.html are not source paths.\n"
        "[ok](" + (ROOT / "docs" / "performance.md").as_posix() + "#method) [bad](missing.md) "
        "[no heading](" + (ROOT / "docs" / "performance.md").as_posix() + "#no-such-heading)\n"
    )
    assert missing_paths(doc) == ["src/msmon/nowhere.py", "benchmarks/gone_cost.py"]
    assert broken_links(doc) == ["missing.md", (ROOT / "docs" / "performance.md").as_posix() + "#no-such-heading"]
    assert len([p for d in DOCS for p in named_paths(d.read_text())]) > 100  # the docs name many paths


def test_heading_anchors_follow_github_slugs():
    markdown = (
        "# After the run: `msmon db`, `report` and `analyse` at scale\n## Method\n## Method\n"
        "```\n# not a heading\n```\n"
    )
    assert heading_anchors(markdown) == {"after-the-run-msmon-db-report-and-analyse-at-scale", "method", "method-1"}
