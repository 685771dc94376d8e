"""Looking inside a model: cached activations, hooks, attention maps, logit lens, HTML report.

    logits, cache = run_with_cache(model, ids)
    plot_attention(cache, layer=0, head=1, tokens=to_str_tokens(model, ids), path="attn")
    write_report(model, "The capital of France is", "report.html")
"""

from lucidlm.inspect.cache import ActivationCache, run_with_cache, run_with_hooks
from lucidlm.inspect.logit_lens import LogitLens, logit_lens
from lucidlm.inspect.plots import (plot_attention, plot_attention_heads, plot_logit_lens,
                                   plot_position_encodings, plot_rope_angles)
from lucidlm.inspect.report import build_report, write_report
from lucidlm.inspect.steps import generation_steps, print_steps, to_str_tokens, to_tokens
from lucidlm.inspect.tokens import to_string
from lucidlm.inspect.views import AttentionView, attention_view

__all__ = [
    "ActivationCache", "AttentionView", "LogitLens", "attention_view", "to_string", "build_report", "generation_steps", "logit_lens", "plot_attention",
    "plot_attention_heads", "plot_logit_lens", "plot_position_encodings", "plot_rope_angles", "print_steps",
    "run_with_cache", "run_with_hooks", "to_str_tokens", "to_tokens", "write_report",
]

# loss_plot.py is written by the training side: re-export its plot functions once it exists.
try:
    from lucidlm.inspect import loss_plot
except ImportError:
    loss_plot = None
else:
    for _name in getattr(loss_plot, "__all__", [n for n in dir(loss_plot) if n.startswith("plot_")]):
        globals()[_name] = getattr(loss_plot, _name)
        __all__.append(_name)
