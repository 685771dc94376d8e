"""``lucidlm chat``: an interactive conversation with a chat model, answers streamed."""

from __future__ import annotations

import argparse
import sys
from contextlib import closing
from typing import Any, Callable, Optional, TextIO

from lucidlm.commands.generate import add_model_arguments, add_sampling_arguments, load_model_from_args, sampling_kwargs
from lucidlm.errors import LucidLMError

HELP_TEXT = "commands: /reset (forget the conversation), /system TEXT (new system prompt and reset), /exit"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal (streams its answers)",
        description="An interactive chat using the model's chat template. With no --model, uses the embedded "
                    "SmolLM2-135M-Instruct. " + HELP_TEXT + ". Ctrl-C stops an answer; Ctrl-C at the prompt "
                    "or Ctrl-D exits. Reads one message per line when stdin is not a terminal.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--system", metavar="TEXT", default=None,
                        help="system prompt (default: the chat template's own, if it has one)")
    add_sampling_arguments(parser, default_max_new_tokens=256)
    parser.set_defaults(handler=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    from lucidlm.generation import check_options

    kwargs = sampling_kwargs(args)
    check_options(**kwargs)
    model = load_model_from_args(args)
    return chat_loop(model, kwargs, system=args.system)


def chat_loop(model: Any, gen_kwargs: dict[str, Any], system: Optional[str] = None,
              read_line: Callable[[str], str] = input, out: Optional[TextIO] = None) -> int:
    """The REPL. ``read_line`` and ``out`` are parameters so tests can drive it."""
    from lucidlm.chat import Conversation

    out = out if out is not None else sys.stdout
    convo = Conversation(system=system)
    interactive = sys.stdin.isatty()
    if interactive:
        out.write(f"lucidlm chat - {HELP_TEXT}\n")
    while True:
        try:
            line = read_line("> " if interactive else "")
        except EOFError:  # Ctrl-D, or the end of piped input
            if interactive:
                out.write("\n")
            return 0
        except KeyboardInterrupt:  # Ctrl-C while waiting for input: leave
            out.write("\n")
            return 0
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            command, _, rest = line.partition(" ")
            if command in ("/exit", "/quit"):
                return 0
            if command == "/reset":
                convo.reset()
                out.write("(conversation reset)\n")
            elif command == "/system":
                convo.reset(system=rest.strip() or None, keep_system=False)
                out.write("(system prompt set; conversation reset)\n")
            else:
                out.write(f"unknown command {command!r}; {HELP_TEXT}\n")
            out.flush()
            continue

        convo.add_user(line)
        try:
            with closing(convo.reply(model, **gen_kwargs)) as pieces:
                for piece in pieces:
                    out.write(piece)
                    out.flush()
        except KeyboardInterrupt:  # stop this answer, keep the session
            out.write(" [stopped]")
        except LucidLMError as exc:  # e.g. the conversation outgrew the context: say so, carry on
            convo.history.pop()  # the unanswered user message
            if convo.history and convo.history[-1]["role"] == "user":
                convo.history.pop()
            out.write(f"error: {exc} (type /reset to start over)")
        out.write("\n")
        out.flush()
