"""HTML for notebook displays (``_repr_html_``): unique element ids, CSS scoped to one element,
JSON that is inert inside ``<script>``, whole pages in an iframe. Every display in lucidlm
(results, caches, the lens, attention views, reports) builds on these, so any number of them
can share one notebook page without restyling it or each other. No torch, no model.
"""

from __future__ import annotations

import html
import json
import uuid
from typing import Any


def element_id(kind: str) -> str:
    """A fresh id for one displayed element: CSS and scripts scoped to it never meet another's."""
    return f"lucidlm-{kind}-{uuid.uuid4().hex[:12]}"


def scoped_style(view_id: str, rules: dict[str, str]) -> str:
    """A ``<style>`` block whose every selector starts with ``#view_id``, so it styles that one
    element and nothing else on the page. ``rules`` maps a selector inside the element (``""``
    for the element itself; a comma list is scoped part by part) to its declarations."""
    blocks = []
    for selector, declarations in rules.items():
        parts = [f"#{view_id} {part.strip()}".rstrip() for part in selector.split(",")]
        blocks.append(f"{', '.join(parts)} {{{declarations}}}")
    return "<style>\n" + "\n".join(blocks) + "\n</style>"


def script_json(data: Any, **dump_options: Any) -> str:
    """``data`` as JSON that stays inert inside ``<script>``: ensure_ascii and an escaped '<'
    mean no text the model saw can close the tag, whatever it holds."""
    return json.dumps(data, ensure_ascii=True, **dump_options).replace("<", "\\u003c")


def iframe_html(page: str, kind: str, height: int = 720) -> str:
    """A whole HTML page shown inline: in an iframe its ids, CSS and script are its own, so
    any number of pages (and views) can share one notebook."""
    srcdoc = html.escape(page, quote=True)
    return (f'<iframe id="{element_id(kind)}" class="lucidlm-{kind}" srcdoc="{srcdoc}" '
            f'style="width: 100%; height: {height}px; border: 1px solid #d0d7de" '
            f'sandbox="allow-scripts"></iframe>')
