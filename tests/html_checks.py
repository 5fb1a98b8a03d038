"""HTML as a browser would read it, for the tests of rendered replies (no tests here)."""

from __future__ import annotations

from html.parser import HTMLParser


class _Elements(HTMLParser):
    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))


def elements(out: str) -> list[tuple[str, dict]]:
    """Every element of `out` as (tag, attributes), as a browser would build them."""
    parser = _Elements()
    parser.feed(out)
    return parser.found
