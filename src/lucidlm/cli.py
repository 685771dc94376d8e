"""The ``lucidlm`` command line: ``lucidlm generate | chat | train | finetune | merge | inspect | convert``.

Each subcommand lives in ``lucidlm/commands/<name>.py`` with ``register(subparsers)``; its
handler returns an exit code. Errors of lucidlm's own types print one clear line (no
traceback) and exit with status 1.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from lucidlm.errors import LucidLMError

COMMANDS = ("generate", "chat", "train", "finetune", "merge", "inspect", "convert")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lucidlm",
        description="A glass-box toolkit for decoder-only transformer language models: run, chat with, "
                    "train, fine-tune and look inside LLMs. With no --model, commands use the embedded "
                    "SmolLM2-135M-Instruct.",
    )
    from lucidlm import __version__
    parser.add_argument("--version", action="version", version=f"lucidlm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"lucidlm.commands.{name}")
        module.register(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except LucidLMError as exc:
        print(f"lucidlm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nlucidlm {args.command}: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lucidlm generate ... | head` closes the pipe early
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
