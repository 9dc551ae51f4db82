"""The manual: the README and its chapters in docs/ link only to files that exist, and the
README links every chapter."""

from __future__ import annotations

import re

from tests.helpers import ROOT

#: ``[text](target)``; targets with a scheme (``https:``) or only an anchor are not files.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def manual_files():
    return [ROOT / "README.md", ROOT / "serve" / "DESIGN.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_of_the_manual_resolves():
    broken = []
    for page in manual_files():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def test_the_readme_links_every_chapter():
    readme = (ROOT / "README.md").read_text()
    chapters = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md"))]
    assert chapters
    assert [c for c in chapters if f"]({c})" not in readme] == []
