"""Chapter 05 reads as an overview: its first pass (the collectives, DDP rebuilt,
sharding) is at most 4,500 words, about half an hour with the commands; derivations,
proofs and measurement details sit in each page's "Going deeper" section or on pages
whose title says they go deeper."""

from __future__ import annotations

import re

from conftest import REPO

CH = REPO / "05-collectives"
FIRST_PASS = ("README.md", "data-parallel.md", "sharding.md")


def first_pass_words(page) -> int:
    """A page's words but its Going deeper section (from that heading to the next of its
    level)."""
    text = page.read_text()
    text = re.sub(r"^## Going deeper\n.*?(?=^## )", "", text, flags=re.S | re.M)
    return len(text.split())


def test_the_first_pass_is_at_most_4500_words():
    words = {name: first_pass_words(CH / name) for name in FIRST_PASS}
    assert sum(words.values()) <= 4500, words
    for name in FIRST_PASS:  # each ends with what to read later
        assert "\n## Going deeper\n" in (CH / name).read_text(), name


def test_every_other_page_says_it_goes_deeper_and_the_first_pass_links_it():
    first_pass = "".join((CH / name).read_text() for name in FIRST_PASS)
    others = sorted(p for p in CH.glob("*.md") if p.name not in FIRST_PASS)
    assert others
    for page in others:
        assert page.read_text().startswith("# Going deeper: "), page.name
        assert "going deeper: [" in first_pass.lower() and f"]({page.name})" in first_pass, page.name
