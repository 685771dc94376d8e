"""Views that display inline in Jupyter (``_repr_html_``): self-contained HTML, no network.

    view = attention_view(model, "The capital of France is")   # last cell of a notebook: shows it
    view                                                        # pick layer and head, hover a token

Each view gets its own element id, its CSS is scoped to that id and its script finds its
elements through it, so any number of views live on one page (as circuitsvis's do).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lucidlm.display import element_id, iframe_html, scoped_style, script_json  # noqa: F401 (re-exported: their home)
from lucidlm.errors import InputError
from lucidlm.inspect.cache import ActivationCache, run_with_cache, token_columns
from lucidlm.inspect.tokens import TextOrLooseIds, check_cache_fits, one_sequence
from lucidlm.suggest import keywords_checked

_TEMPLATE = """<div id="__ID__" class="lucidlm-attention">
<style>
#__ID__ {font-family: sans-serif; font-size: 13px}
#__ID__ .tokens span {display: inline-block; padding: 2px 3px; margin: 1px; border: 1px solid #ddd;
  white-space: pre; font-family: monospace; cursor: pointer}
#__ID__ .grid {display: grid; gap: 1px; margin-top: 6px}
#__ID__ .grid div {width: 14px; height: 14px}
</style>
<label>layer <select class="layer"></select></label>
<label>head <select class="head"></select></label>
<div class="tokens"></div>
<div class="grid"></div>
<script type="application/json" class="data">__DATA__</script>
<script>
(function () {
  const root = document.getElementById("__ID__");
  const data = JSON.parse(root.querySelector("script.data").textContent);
  const layerSel = root.querySelector("select.layer"), headSel = root.querySelector("select.head");
  const tokensBox = root.querySelector(".tokens"), grid = root.querySelector(".grid");
  const T = data.tokens.length;
  data.patterns.forEach((_, l) => layerSel.add(new Option(String(l), String(l))));
  data.patterns[0].forEach((_, h) => headSel.add(new Option(String(h), String(h))));
  const shade = w => "rgba(33, 102, 172, " + w.toFixed(3) + ")";
  const spans = data.tokens.map((t, i) => {
    const s = document.createElement("span");
    s.textContent = t.replace(/\\n/g, "\\\\n") || "\\u2205";
    s.dataset.pos = String(i);
    tokensBox.appendChild(s);
    return s;
  });
  function pattern() { return data.patterns[+layerSel.value][+headSel.value]; }
  function drawGrid() {
    const p = pattern();
    grid.style.gridTemplateColumns = "repeat(" + T + ", 14px)";
    grid.replaceChildren();
    p.forEach((row, q) => row.forEach((w, k) => {
      const c = document.createElement("div");
      c.className = "cell"; c.style.background = shade(w);
      c.title = data.tokens[q] + " -> " + data.tokens[k] + ": " + w.toFixed(3);
      grid.appendChild(c);
    }));
  }
  function hover(q) {  // colour every token by how much the hovered query attends to it
    const row = pattern()[q];
    spans.forEach((s, k) => { s.style.background = k <= q ? shade(row[k]) : "";
                              s.style.outline = k === q ? "2px solid #b2182b" : ""; });
  }
  spans.forEach((s, q) => s.addEventListener("mouseenter", () => hover(q)));
  layerSel.addEventListener("change", drawGrid); headSel.addEventListener("change", drawGrid);
  drawGrid(); hover(T - 1);
})();
</script>
</div>"""


class AttentionView:
    """Every head's attention pattern for one sequence, shown as an interactive view."""

    def __init__(self, tokens: list[str], patterns: torch.Tensor) -> None:
        self.tokens = tokens
        self.patterns = patterns  # (layers, heads, T, T)

    def _repr_html_(self) -> str:
        """The view's HTML, under an id made fresh for each call: showing one view twice (a cell's
        result, then ``display(view)``) puts two elements on the page that never share an id."""
        data = {"tokens": self.tokens, "patterns": [[[[round(float(w), 4) for w in row] for row in head]
                                                     for head in layer] for layer in self.patterns.tolist()]}
        return _TEMPLATE.replace("__ID__", element_id("attn")).replace("__DATA__", script_json(data))


@keywords_checked(InputError)
def attention_view(model: nn.Module, text_or_ids: TextOrLooseIds,
                   cache: Optional[ActivationCache] = None) -> AttentionView:
    """The attention view of one sequence, as ``logit_lens`` reads it: a text or ids (T,); of a
    (B, T) batch row 0, of a list of texts the first (taken alone, unpadded). ``cache``: one
    ``run_with_cache`` made of that same sequence (row 0 of a batch cache); a cache of another
    length is refused, as its rows would sit under the wrong tokens."""
    from lucidlm.inspect.tokens import id_batch, to_str_tokens
    ids = id_batch(model, one_sequence(text_or_ids), "attention_view")[:1]  # (1, T)
    if cache is None:
        with torch.no_grad():
            _, cache = run_with_cache(model, ids, names_filter=lambda n: n.endswith("hook_pattern"))
    if cache.key_slots is not None:  # (T_new, slots) patterns: not the (T, T) grid of one sequence the view draws
        raise InputError("attention_view shows a whole sequence, but this cache was recorded at a KV-cached step "
                         "(run_with_cache(..., input_pos=...)); record it without input_pos, or plot one head's "
                         "row over the cache slots with plot_attention(cache, layer, head).")
    # The first sequence's (nh, T, S) per layer (a cache recorded with remove_batch_dim=True has
    # no batch dim to index), a prefix's keys left out: (L, nh, T, T).
    per_layer = [cache["pattern", layer] for layer in range(model.config.n_layers)]
    patterns = torch.stack([token_columns(p[0] if cache.has_batch_dim else p) for p in per_layer]).float().cpu()
    tokens = to_str_tokens(model, ids[0]) if getattr(model, "tokenizer", None) is not None else \
        [str(i) for i in ids[0].tolist()]
    check_cache_fits(patterns.shape[-1], len(tokens), "attention_view")
    return AttentionView(tokens, patterns)
