"""README and the docs as a set of pages: every relative link resolves, and README stays an entry point.

README is the newcomer's entry point (at most 150 lines, its test command the one CI runs); the rest is
under docs/, listed by docs/index.md. A moved or renamed page breaks a link here instead of in a reader's hands.
"""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """The targets of a page's relative Markdown links ``](path)``, without their ``#anchor``.

    Example:
        >>> relative_links("see [a](docs/a.md#x), [b](https://b.org), [c](#top) and ![d](img/d.png)")
        ['docs/a.md', 'img/d.png']
    """
    targets = (t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text))
    return [t for t in targets if t and not re.match(r"[a-z]+:", t)]


def test_every_relative_link_in_readme_and_docs_points_at_a_file():
    broken = [f"{page.relative_to(ROOT)}: {target}" for page in PAGES
              for target in relative_links(page.read_text()) if not (page.parent / target).exists()]
    assert not broken, f"links to nothing: {broken}"


def test_the_index_lists_every_docs_page():
    index = set(relative_links((ROOT / "docs" / "index.md").read_text()))
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")} - {"index.md"}
    assert not pages - index, f"docs/index.md does not list: {sorted(pages - index)}"


def test_readme_is_an_entry_point_with_the_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    command = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert command.startswith("python3 -m venv") and f"\n    {command}\n" in readme
