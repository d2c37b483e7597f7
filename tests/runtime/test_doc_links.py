"""Every link between the docs resolves: a `page.md` link names a file that exists, and a
`page.md#anchor` or `#anchor` link names a heading of its page, by GitHub's rule for anchors
(lower case, punctuation but '-' and '_' dropped, spaces to '-', a repeated heading's -1, -2, ...).
Pages move and headings change; a link that silently lands at the top of a page is the cost."""
import re
from pathlib import Path

from helpers.launcher import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s#]*\.md)?(?:#([^)\s]+))?\)")


def anchors(page: Path) -> set:
    seen, found, fenced = {}, set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if fenced or not re.match(r"#{1,6} ", line):
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line.lstrip("#").strip())  # a link's text only
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        repeats = seen.get(slug, 0)
        seen[slug] = repeats + 1
        found.add(slug if repeats == 0 else f"{slug}-{repeats}")
    return found


def test_every_link_between_the_docs_names_a_page_and_a_heading_that_exist():
    assert len(PAGES) > 10
    broken = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for link in LINK.finditer(text):
            target, anchor = link.groups()
            if target is None and anchor is None:
                continue
            where = f"{page.relative_to(REPO)}:{text[:link.start()].count(chr(10)) + 1}"
            linked = page if target is None else (page.parent / target)
            if not linked.is_file():
                broken.append(f"{where}: no page {target}")
            elif anchor is not None and anchor not in anchors(linked):
                broken.append(f"{where}: no heading #{anchor} in {linked.name}")
    assert not broken, "\n".join(broken)
