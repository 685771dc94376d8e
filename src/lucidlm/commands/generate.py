"""``lucidlm generate PROMPT``: continue a prompt (or answer it, with --chat)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lucidlm.errors import GenerationError

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="continue a prompt with a model (KV-cached sampling, beam search, streaming)",
        description="Generate text from PROMPT. With no --model, uses the embedded SmolLM2-135M-Instruct. "
                    "Prints the generated text only (not the prompt).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="examples:\n"
               "  lucidlm generate 'Once upon a time' --temperature 0 --max-new-tokens 40\n"
               "  lucidlm generate 'What is the capital of France?' --chat --stream\n"
               "  lucidlm generate 'The' --model gpt2-dir/ --top-p 0.9 --seed 1 --json",
    )
    parser.add_argument("prompt", metavar="PROMPT", help="the text to continue (or the user message with --chat)")
    add_model_arguments(parser)
    add_sampling_arguments(parser, default_max_new_tokens=64)
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams (1 = off; "
                        "ignores temperature/top-k/top-p/min-p)")
    parser.add_argument("--length-penalty", type=float, default=1.0,
                        help="beam search: score = sum of log-probs / length ** this (> 0 favours longer outputs)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap PROMPT as a user message in the model's chat template")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object {"prompt_ids": [...], "token_ids": [...], "text": "..."} '
                             "(token_ids: generated ids only)")
    parser.set_defaults(handler=run_generate)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", metavar="SOURCE", default="smollm2-135m",
                        help="model to load: a .gguf file, a Hugging Face or lucidlm model directory, a "
                             "pretrained name (smollm2-135m: the embedded model) or a preset")
    parser.add_argument("--adapter", metavar="DIR", default=None,
                        help="LoRA / prefix-tuning adapter directory to apply")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights' dtype")


def add_sampling_arguments(parser: argparse.ArgumentParser, default_max_new_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens,
                       help="most tokens to generate (fewer if EOS, a stop string or the context end comes first)")
    group.add_argument("--temperature", type=float, default=0.7,
                       help="softmax temperature; 0 = greedy (always the most likely token)")
    group.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    group.add_argument("--top-p", type=float, default=None,
                       help="nucleus sampling: the smallest set of tokens with total probability >= p, in (0, 1]")
    group.add_argument("--min-p", type=float, default=None,
                       help="drop tokens less likely than min_p x the most likely one, in [0, 1]")
    group.add_argument("--repetition-penalty", type=float, default=None,
                       help="> 1 discourages tokens already in the text (CTRL / HF style)")
    group.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="stop when TEXT appears (not included in the output); repeatable")
    group.add_argument("--min-new-tokens", type=int, default=0,
                       help="EOS cannot end the output before this many new tokens")
    group.add_argument("--context-overflow", choices=("stop", "crop"), default="stop",
                       help="at the end of the context window: stop, or crop to its last max_seq_len tokens "
                            "and go on (seed 003's sliding generation; slower, no KV cache past that point)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                seed=args.seed, stop=args.stop, min_new_tokens=args.min_new_tokens,
                context_overflow=args.context_overflow)


def load_model_from_args(args: argparse.Namespace) -> Any:
    import torch

    import lucidlm

    model = lucidlm.load(args.model, dtype=getattr(torch, args.dtype), device=args.device, adapter=args.adapter)
    model.eval()
    return model


def run_generate(args: argparse.Namespace) -> int:
    from lucidlm.generation import check_options, generate, stream

    kwargs = dict(sampling_kwargs(args), num_beams=args.num_beams, length_penalty=args.length_penalty, chat=args.chat)
    check_options(**kwargs)  # a typo in a flag should not cost a model load
    model = load_model_from_args(args)
    if model.tokenizer is None:
        raise GenerationError(f"model {args.model!r} has no tokenizer, so it cannot read a text prompt; "
                              f"use a model directory or GGUF file that includes one.")
    if args.json:
        result = generate(model, args.prompt, **kwargs)
        print(json.dumps({"prompt_ids": result.prompt_ids, "token_ids": result.token_ids, "text": result.text},
                         ensure_ascii=False))
    elif args.stream:
        for piece in stream(model, args.prompt, **kwargs):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    else:
        print(generate(model, args.prompt, **kwargs).text)
    return 0
