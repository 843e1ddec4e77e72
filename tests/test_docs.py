"""The README and docs/ hold together: relative links resolve, the README stays a product page, and no tracker
numbers leak into what users read."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").rglob("*.md"))]


def _anchors(page: Path) -> set[str]:
    """GitHub-style heading anchors of a Markdown page."""
    found = set()
    for line in page.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists() or (anchor and destination.is_file() and anchor not in _anchors(destination)):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_readme_is_a_product_page():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250


def test_readme_test_command_is_what_ci_runs():
    command = re.search(r"python -m pip install .*pytest -q", (REPO / ".ci" / "run").read_text()).group(0)
    assert command in (REPO / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("page", [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_no_tracker_numbers_in_user_pages(page):
    assert not re.search(r"\bissues? *#?\d+", page.read_text(encoding="utf-8"), flags=re.I)
