"""``lucidlm inspect TEXT --out report.html``: one forward pass, shown as a self-contained HTML page."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from lucidlm.commands import arg_types
from lucidlm.errors import InputError
from lucidlm.outputs import check_output_dir, check_output_file, writing


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="look inside the model: tokens, top-k predictions, attention maps, logit lens (HTML report)",
        description="Run TEXT through the model once and write a single self-contained HTML page (no network "
                    "needed to view it) showing: the tokens; the top-k next-token probabilities at every "
                    "position; the attention pattern of any layer and head (pick them in the page); and the "
                    "logit lens (the top guess read off every layer's residual stream). With --plots, also "
                    "write PNG and SVG figures of the attention heads of every layer and of the logit lens.",
        epilog="examples:\n"
               "  lucidlm inspect \"The capital of France is\" --out report.html\n"
               "  lucidlm inspect \"To be, or not to be\" --model runs/shakespeare --top-k 10 --out shake.html\n"
               "  lucidlm inspect \"Hello\" --plots figures/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("text", metavar="TEXT", type=arg_types.text, help="the text to run through the model")
    parser.add_argument("--model", metavar="SOURCE", default="smollm2-135m",
                        help="model to inspect: a pretrained name (default: the embedded smollm2-135m), a .gguf "
                             "file, a Hugging Face directory, or a lucidlm model/checkpoint directory; it must come "
                             "with a tokenizer")
    parser.add_argument("--adapter", metavar="PATH", default=None, help="a LoRA/adapter directory to apply first")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA if torch sees a GPU, else CPU), cpu, cuda, cuda:N or mps (default: auto)")
    parser.add_argument("--out", metavar="FILE", default="report.html",
                        help="HTML file to write (default: report.html)")
    parser.add_argument("--top-k", type=int, default=5, metavar="K",
                        help="how many next-token candidates to list per position (default: 5)")
    parser.add_argument("--plots", metavar="DIR", default=None,
                        help="also write attention_layer<L>.png/.svg for every layer and logit_lens.png/.svg to DIR")
    parser.add_argument("-q", "--quiet", action="store_true", help="no loading line on stderr")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from lucidlm.commands.generate import load_model_from_args

    if not args.text:
        raise InputError("TEXT is empty; give the text to inspect, e.g. lucidlm inspect \"Hello world\".")
    if args.top_k < 1:
        raise InputError(f"--top-k {args.top_k}: give a number of candidates >= 1.")
    out = check_output_file(args.out, "--out")  # before the model loads: a bad path costs nothing
    if args.plots:
        args.plots = check_output_dir(args.plots, "--plots")  # "~" expanded: the path written below

    def refuse_replacing_the_model() -> None:  # imports torch (the model files' names): after the loading line
        from lucidlm.commands.model_dir import refuse_writing_over_input
        refuse_writing_over_input(out, {"--model": args.model, "--adapter": args.adapter}, "--out")

    args.dtype = "float32"  # the exact float model
    model = load_model_from_args(args, checks=refuse_replacing_the_model)  # its loading line at once
    from lucidlm.inspect.report import write_report

    if args.plots:  # made before the report is written: a --plots that cannot be made leaves no report
        with writing(args.plots, "--plots"):
            args.plots.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with writing(args.out, "--out"):
        out = write_report(model, args.text, args.out, top_k=args.top_k,
                           title=f"lucidlm inspect: {args.model}")
    print(f"wrote {out} ({out.stat().st_size / 1e3:.0f} kB) in {time.perf_counter() - start:.1f} s")
    if args.plots:
        with writing(args.plots, "--plots"):
            written = _write_plots(model, args.text, args.plots)
        print(f"wrote {len(written)} figures to {args.plots}")
    return 0


def _write_plots(model, text: str, directory: Path) -> list[Path]:
    import torch

    from lucidlm.inspect.cache import run_with_cache
    from lucidlm.inspect.logit_lens import logit_lens
    from lucidlm.inspect.plots import plot_attention_heads, plot_logit_lens, save_figure
    from lucidlm.inspect.steps import to_str_tokens

    tokens = to_str_tokens(model, text)
    written: list[Path] = []
    with torch.no_grad():
        _, cache = run_with_cache(model, text, names_filter=lambda name: name.endswith("hook_pattern"))
        for layer in range(model.config.n_layers):
            written += save_figure(plot_attention_heads(cache, layer, tokens), directory / f"attention_layer{layer}")
        written += save_figure(plot_logit_lens(logit_lens(model, text)), directory / "logit_lens")
    return written
