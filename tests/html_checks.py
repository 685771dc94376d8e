"""Checks shared by the tests of lucidlm's notebook displays (``_repr_html_``)."""

import re


def element_ids(page: str) -> list[str]:
    return re.findall(r'id="([^"]+)"', page)


def assert_css_scoped(page: str, view_id: str) -> None:
    """Every selector of every ``<style>`` block starts with ``#view_id``: two displays on one
    page cannot restyle each other, or the page around them."""
    styles = re.findall(r"<style>(.*?)</style>", page, re.S)
    assert styles
    for css in styles:
        for block in css.split("}"):
            if not block.strip():
                continue
            for selector in block.split("{")[0].split(","):
                assert selector.strip().startswith(f"#{view_id}"), selector
