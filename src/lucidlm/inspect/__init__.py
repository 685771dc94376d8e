"""Looking inside a model: cached activations, hooks, attention maps, logit lens, HTML report.

    logits, cache = run_with_cache(model, ids)
    plot_attention(cache, layer=0, head=1, tokens=to_str_tokens(model, ids), path="attn")
    write_report(model, "The capital of France is", "report.html")
"""

from lucidlm.inspect.cache import ActivationCache, run_with_cache, run_with_hooks
from lucidlm.inspect.logit_lens import LogitLens, logit_lens
from lucidlm.inspect.report import build_report, write_report
from lucidlm.inspect.steps import generation_steps, print_steps, to_str_tokens, to_tokens
from lucidlm.inspect.tokens import to_string
from lucidlm.inspect.views import AttentionView, attention_view

__all__ = [
    "ActivationCache", "AttentionView", "LogitLens", "attention_view", "to_string", "build_report", "generation_steps", "logit_lens", "plot_attention",
    "plot_attention_heads", "plot_logit_lens", "plot_position_encodings", "plot_rope_angles", "print_steps",
    "run_with_cache", "run_with_hooks", "to_str_tokens", "to_tokens", "write_report",
]

# The plots need matplotlib (0.3 s to import, ~30 MB): they load on first use, so that
# ``lucidlm generate`` and ``lucidlm.load`` (which import this package for run_with_cache)
# never pay for them. ``from lucidlm.inspect import plot_attention`` works as before.
_LAZY = {name: "lucidlm.inspect.plots" for name in ("plot_attention", "plot_attention_heads", "plot_logit_lens",
                                                    "plot_position_encodings", "plot_rope_angles")}
_LAZY.update(plot_loss_curves="lucidlm.inspect.loss_plot", read_metrics="lucidlm.inspect.loss_plot")


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'lucidlm.inspect' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
