"""``lucidlm perplexity --data FILE``: a model's perplexity on a text, by Hugging Face's
sliding-window recipe (``lucidlm/evaluation.py``); with ``--kl-base SOURCE``, also its KL
divergence from that model, token by token (``lucidlm/divergence.py``)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from lucidlm.commands import arg_types
from lucidlm.commands.generate import add_model_arguments


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "perplexity",
        help="score a text file with a model: perplexity over sliding windows",
        description="Perplexity of the model on a text: exp(mean -log p) of each token given the tokens before "
                    "it, read in windows of --context tokens starting every --stride tokens, each scoring only "
                    "the tokens no earlier window scored (Hugging Face's \"perplexity of fixed-length models\" "
                    "recipe). The text is tokenized once as a whole, with BOS first only if the model's tokenizer "
                    "adds one. With no --model, uses the embedded SmolLM2-135M-Instruct.",
        formatter_class=arg_types.HelpFormatter,
        epilog="examples:\n"
               "  lucidlm perplexity --data ../shared/data/tinyshakespeare.txt --context 256 --stride 256\n"
               "  lucidlm perplexity --data notes.txt --model gemma3-270m --dtype float32 --json\n"
               "  lucidlm perplexity --data corpus/ --model runs/char --batch-size 8\n"
               "  lucidlm perplexity --data notes.txt --quantize int4 --kl-base smollm2-135m   # int4 vs float32",
    )
    parser.add_argument("--data", metavar="PATH", required=True,
                        help="UTF-8 text file to score, or a folder: its .txt files, joined by blank lines")
    add_model_arguments(parser, decodes=False)
    parser.add_argument("--context", type=int, default=None, metavar="N",
                        help="tokens per window (default: the model's context, at most 1024)")
    parser.add_argument("--stride", type=int, default=None, metavar="N",
                        help="tokens between window starts, 1..--context (default: half the window; = --context: "
                             "no overlap, fastest, each window's first token unscored)")
    parser.add_argument("--batch-size", type=int, default=1, metavar="B",
                        help="windows per forward pass (same figure; faster, B x context x vocab floats of logits)")
    parser.add_argument("--kl-base", metavar="SOURCE", default=None,
                        help="also compare the model with this one (as --model, loaded in float32: its exact float "
                             "path) on the same windows, as llama.cpp's llama-perplexity KL-divergence mode: the KL "
                             "divergence of the model's next-token distributions from its (mean, quantiles), how "
                             "often their most likely tokens agree, and both perplexities")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object: ppl, nll (mean nats per token), tokens (scored), text_tokens, "
                             "max_length, stride, windows (begin, end, tokens, nll each), load_seconds, seconds; "
                             "with --kl-base: tokens, ppl, base_ppl, ln_ppl_ratio, kld_mean, kld_stderr, "
                             "kld_quantiles, same_top, same_top_stderr, delta_p_mean, delta_p_rms, text_tokens, "
                             "max_length, stride, load_seconds, seconds")
    parser.set_defaults(handler=run)


def check_window_flags(args: argparse.Namespace) -> None:
    """--context, --stride and --batch-size, as far as they can be checked without the model
    (its context bounds --context and, when --context is not given, --stride)."""
    from lucidlm.errors import InputError
    from lucidlm.validation import check_int

    for flag, value, low in (("--context", args.context, 2), ("--stride", args.stride, 1)):
        if value is not None:
            check_int(value, flag, InputError, low=low)
    check_int(args.batch_size, "--batch-size", InputError, low=1)
    if args.context is not None and args.stride is not None and args.stride > args.context:
        raise InputError(f"--stride {args.stride} is longer than --context {args.context}: the tokens between "
                         f"windows would be left unread; give a stride <= the context.")


def run(args: argparse.Namespace) -> int:
    from lucidlm.commands.generate import _json_line, _json_number, check_second_model, load_model_from_args
    from lucidlm.errors import InputError
    from lucidlm.training.corpus import corpus_files, read_corpus

    check_window_flags(args)  # a bad flag or file costs no model load
    text = "\n\n".join(read_corpus(corpus_files(args.data, "evaluation"), "evaluation"))
    base_checks = (lambda: check_second_model(args.kl_base, "--kl-base", "give the path of the model to compare "
                                              "with")) if args.kl_base is not None else None
    model = load_model_from_args(args, checks=base_checks)
    if model.tokenizer is None:
        raise InputError(f"model {args.model!r} has no tokenizer, so it cannot read text; use a model directory "
                         f"or GGUF file that includes one.")
    from lucidlm.evaluation import perplexity, window_settings

    if args.kl_base is not None:
        return _compare(args, model, text, _json_line, _json_number)
    max_length, stride = window_settings(model.config.max_seq_len, args.context, args.stride, ("--context", "--stride"))
    start = time.perf_counter()
    result = perplexity(model, text, max_length=max_length, stride=stride, batch_size=args.batch_size,
                        progress=not args.quiet and sys.stderr.isatty())
    seconds = time.perf_counter() - start
    if args.json:
        data = result.to_dict()  # a diverged model's inf (or a NaN's) as null: json.dumps writes Infinity, not JSON
        data.update(ppl=_json_number(data["ppl"]), nll=_json_number(data["nll"]),
                    windows=[{**w, "nll": _json_number(w["nll"])} for w in data["windows"]])
        print(_json_line({**data, "load_seconds": round(getattr(args, "load_seconds", 0.0), 4),
                          "seconds": round(seconds, 4)}))
    else:
        print(f"perplexity {result.ppl:.4f} (nll {result.nll:.4f} nats/token) over {result.tokens:,} tokens of "
              f"{args.data}: {len(result.windows)} window{'' if len(result.windows) == 1 else 's'} of {max_length}, "
              f"stride {stride}, {seconds:.1f} s")
    return 0


def _compare(args: argparse.Namespace, model: Any, text: str, json_line: Any, json_number: Any) -> int:
    """--kl-base: the base model loaded (float32), both read on the same windows."""
    import torch

    import lucidlm
    from lucidlm.divergence import kl_divergence
    from lucidlm.evaluation import window_settings

    from lucidlm.commands.loading_status import LoadingStatus

    with LoadingStatus(f"loading {args.kl_base} (float32) to compare with", enabled=not args.quiet):
        base = lucidlm.load(args.kl_base, dtype=torch.float32, device=args.device)
    context = min(model.config.max_seq_len, base.config.max_seq_len)
    max_length, stride = window_settings(context, args.context, args.stride, ("--context", "--stride"))
    start = time.perf_counter()
    result = kl_divergence(model, base, text, max_length=max_length, stride=stride, batch_size=args.batch_size,
                           progress=not args.quiet and sys.stderr.isatty())
    seconds = time.perf_counter() - start
    if args.json:
        data = {key: json_number(value) if isinstance(value, float) else value
                for key, value in result.to_dict().items()}
        data["kld_quantiles"] = {k: json_number(v) for k, v in result.kld_quantiles.items()}
        print(json_line({**data, "load_seconds": round(getattr(args, "load_seconds", 0.0), 4),
                         "seconds": round(seconds, 4)}))
        return 0
    q = result.kld_quantiles
    print(f"perplexity {result.ppl:.4f}, base {result.base_ppl:.4f} (ln ratio {result.ln_ppl_ratio:+.5f}) over "
          f"{result.tokens:,} tokens of {args.data}: windows of {max_length}, stride {stride}, {seconds:.1f} s\n"
          f"KL divergence from {args.kl_base}: mean {result.kld_mean:.6f} +- {result.kld_stderr:.6f} nats; "
          f"median {q['median']:.6f}, 90% {q['90%']:.6f}, 99% {q['99%']:.6f}, 99.9% {q['99.9%']:.6f}, "
          f"max {q['max']:.6f}\n"
          f"same most likely token: {100 * result.same_top:.2f} % +- {100 * result.same_top_stderr:.2f} %; "
          f"p of the text's token, model - base: mean {100 * result.delta_p_mean:+.3f} %, "
          f"RMS {100 * result.delta_p_rms:.3f} %")
    return 0
