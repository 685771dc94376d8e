"""``lucidlm serve``: the model behind OpenAI's HTTP API (``lucidlm/serving/``), for any
OpenAI client: ``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lucidlm.commands import arg_types
from lucidlm.commands.generate import add_draft_arguments, add_model_arguments, check_draft_flags, load_model_and_draft
from lucidlm.errors import GenerationError, InputError

DEFAULT_PARALLEL = 4  # serving.http_server's, spelled out: --help must not import torch (a test keeps them equal)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over HTTP with OpenAI's API (completions, chat completions, streaming)",
        description="Serve the model over HTTP with OpenAI's API: POST /v1/completions and /v1/chat/completions "
                    "(streaming too), GET /v1/models and /health. One batch runs at a time: when the model is "
                    "free, the first request waiting takes along the waiting requests it can decode with, up to "
                    "--parallel rows, and a request that arrives while it runs takes over a row that has ended "
                    "(continuous batching; --no-cont-batching: it waits for the next batch). "
                    "Sampling options a request leaves out take the model's defaults (as "
                    "`lucidlm generate`). Each request is logged on stderr (-q: none). With no --model, serves the "
                    "embedded SmolLM2-135M-Instruct. Ctrl-C stops it.",
        formatter_class=arg_types.HelpFormatter,
        epilog="examples:\n"
               "  lucidlm serve\n"
               "  lucidlm serve --model gemma3-270m --port 8080 --served-model-name gemma\n"
               "  lucidlm serve --port 0 -q   # a free port, no log; the URL is the line on stdout\n"
               "  lucidlm serve --draft prompt   # speculative: greedy answers the same, faster where they copy",
    )
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0: every network interface, reachable from other machines)")
    parser.add_argument("--port", type=arg_types.port, default=8000, help="port to listen on (0: a free one)")
    parser.add_argument("--served-model-name", metavar="NAME", default=None, type=arg_types.text,
                        help="the model's id in /v1/models and in responses (default: --model as given)")
    parser.add_argument("--cache-prompt", action="store_true",
                        help="keep each answer's KV cache for the next request (llama.cpp's cache_prompt; a request's "
                             "\"cache_prompt\" field decides for itself): a chat's next turn, whose prompt is the "
                             "conversation so far, then runs only its new message. Greedy answers stay the same; "
                             "the new tokens' logits round a little otherwise (a shorter pass)")
    parser.add_argument("--parallel", "-np", metavar="N", type=arg_types.parallel_rows, default=DEFAULT_PARALLEL,
                        help=f"decode up to N rows of waiting requests as one batch (llama-server's --parallel): "
                             f"each answer stays what it is alone (greedy: the same tokens, to the bit on quantized "
                             f"models; seeded sampling, "
                             f"log-probs, --cache-prompt and --draft run alone). Default {DEFAULT_PARALLEL}, "
                             f"llama-server's: on SmolLM2, 2 cores, 4 rows decode 2.6x one row's tokens a second, 8 "
                             f"rows 3.7x, but each row's tokens come slower the more rows share a step; 1 serves "
                             f"one request at a time")
    parser.add_argument("--cont-batching", "-cb", action=argparse.BooleanOptionalAction, default=True,
                        help="with --parallel above 1, let a request that arrives while a batch runs join it (in a "
                             "row that has ended, or a new one while there are fewer than --parallel) once the batch "
                             "has run as many steps as its prompt has tokens (llama-server's --cont-batching, on by "
                             "default); --no-cont-batching: it waits until the whole batch ends")
    add_draft_arguments(parser)
    parser.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from lucidlm.serving.http_server import OpenAIServer, serve

    check_draft_flags(args)
    name = args.served_model_name if args.served_model_name is not None else args.model
    try:  # listen first: a port in use is refused before the model loads
        server = OpenAIServer(None, name, args.host, args.port, log_requests=not args.quiet, parallel=args.parallel,
                              cont_batching=args.cont_batching)
    except OSError as exc:
        raise InputError(f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}; choose another --port "
                         f"(0 picks a free one) or --host.") from None
    try:
        server.start_accepting()  # while the model loads, every request gets 503 "Loading model" (llama-server's)
        model = load_model_and_draft(args, server.generation_options)  # with --draft, the draft in it
        if args.cache_prompt:
            server.generation_options["reuse_cache"] = True
        if model.tokenizer is None:
            raise GenerationError(f"model {args.model!r} has no tokenizer, so it cannot read text prompts; use a "
                                  f"model directory or GGUF file that includes one.")
        server.model = model  # the requests from now on are answered
        print(f"lucidlm serve: {server.url} (model {name})", flush=True)
        serve(server, on_stop=lambda: print("lucidlm serve: stopped", file=sys.stderr, flush=True))
    finally:
        server.stop_accepting()
        server.server_close()
    return 0
