"""The README as a first page, the docs behind it, and the files a user of the project expects beside the code."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def markdown_pages() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links in code blocks are not links
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def heading_anchors(page: Path) -> set[str]:
    """The #anchors GitHub gives a page's headings: lowercase, punctuation but hyphens dropped, spaces as hyphens,
    a repeated one numbered."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    anchors, seen = set(), {}
    for heading in re.findall(r"^#+\s+(.*)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_every_relative_link_in_the_readme_and_docs_resolves_to_a_file_and_heading():
    broken = []
    for page in markdown_pages():
        for target in relative_links(page):
            name, _, anchor = target.partition("#")
            path = (page.parent / unquote(name)).resolve() if name else page
            if not path.exists() or ROOT not in path.parents:
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "links to no file or heading in the repository:\n" + "\n".join(broken)


def test_the_link_checker_finds_a_broken_link_and_the_anchors_of_headings(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[ok](https://x.org) [bad](no/such/file.md) `[code](x.md)`\n```\n[in](block.md)\n```\n"
                    "## The bench: `--turns all`\n## Notes\n## Notes\n")
    assert relative_links(page) == ["no/such/file.md", "x.md"]
    assert heading_anchors(page) == {"the-bench---turns-all", "notes", "notes-1"}


def test_the_readme_is_a_first_page_with_both_commands_and_the_screenshot_early():
    text = README.read_text()
    assert len(text) <= 8000, f"README.md has {len(text)} characters; keep it to 8,000 (move detail to docs/)"
    first = text[:3000]
    assert ".venv/bin/python launch.py" in first
    assert 'pytest -m "not slow"' in first
    assert "assets/screenshot.png" in first
    for paper in ("2401.15077", "2406.16858", "2503.01840"):  # EAGLE, EAGLE-2, EAGLE-3
        assert paper in text
    assert "github.com/SafeAILab/EAGLE" in text


def test_ci_runs_the_readmes_test_command():
    command = next(line for line in README.read_text().splitlines() if 'pytest -m "not slow"' in line)
    assert command.strip() in (ROOT / ".ci" / "run").read_text()


def test_the_benchmarks_page_stays_readable():
    size = len((ROOT / "docs" / "benchmarks.md").read_text())
    assert size <= 32000, f"docs/benchmarks.md has {size} characters: move dated detail to docs/history/"


def test_license_and_citation_name_the_papers():
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    citation = (ROOT / "CITATION.cff").read_text()
    for paper in ("2401.15077", "2406.16858", "2503.01840"):
        assert f"arXiv:{paper}" in citation
