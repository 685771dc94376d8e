"""The ``lucidlm`` command line: ``lucidlm generate | chat | serve | train | finetune | merge | inspect |
convert | perplexity``.

Each subcommand lives in ``lucidlm/commands/<name>.py`` with ``register(subparsers)``; its
handler returns an exit code. Errors of lucidlm's own types print one clear line (no
traceback) and exit with status 1, as does a dependency that is not installed (named with its
pip install). Any other exception is a bug: it prints one line saying so and how to see the
traceback (``LUCIDLM_DEBUG=1``), and exits with status 70.

Only the chosen subcommand's module is imported (the others appear in ``--help`` by their
one-line summary), so ``lucidlm --help`` and ``--version`` start without importing torch.
A mistyped command, flag or choice is answered with one line and a "did you mean".
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import sys
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, NoReturn, Optional, Sequence, TextIO

from lucidlm.errors import InputError, LucidLMError, OutputError
from lucidlm.suggest import did_you_mean
from lucidlm.validation import printable

COMMANDS = ("generate", "chat", "serve", "train", "finetune", "merge", "inspect", "convert", "perplexity")
SUMMARIES = {  # shown by `lucidlm --help`; tests check they match each command's own help
    "generate": "continue a prompt with a model (KV-cached sampling, beam search, streaming)",
    "chat": "chat with a model in the terminal (streams its answers)",
    "serve": "serve a model over HTTP with OpenAI's API (completions, chat completions, streaming)",
    "train": "train a model from scratch on a text corpus",
    "finetune": "fine-tune a pretrained model with LoRA, adapters, prefix tuning or all weights",
    "merge": "merge a LoRA adapter into its base model and save the result",
    "inspect": "look inside the model: tokens, top-k predictions, attention maps, logit lens (HTML report)",
    "convert": "convert a model to Hugging Face or lucidlm format",
    "perplexity": "score a text file with a model: perplexity over sliding windows",
}
# Commands that write nothing but stdout/stderr: run as the program, they leave without the
# interpreter's teardown (see _leave_now). serve too: a request's thread may still be inside torch
# when Ctrl-C ends it, and tearing torch down under a running thread can crash.
FAST_EXIT = ("generate", "serve")
# Commands whose stdout is a log of work still under way (its product is files): a closed pipe
# stops them unfinished, and must not exit 0.
LOG_ON_STDOUT = ("train", "finetune")
INTERNAL_ERROR = "internal error"  # the hostile-input tests fail if any case reaches this line
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)'")


class CommandListFormatter(argparse.HelpFormatter):
    """``lucidlm --help``: each command's summary beside its name. argparse measures the command
    names at the COMMAND line's indent, one step short of their own, so the longest name
    (perplexity) had its summary pushed onto a line of its own."""

    def add_argument(self, action: argparse.Action) -> None:
        super().add_argument(action)
        for sub in getattr(action, "_get_subactions", list)():  # listed one indent deeper than the action
            width = len(self._format_action_invocation(sub)) + self._current_indent + self._indent_increment
            self._action_max_length = max(self._action_max_length, width)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors that suggest the closest valid name."""

    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:
        self._argv = list(sys.argv[1:] if args is None else args)  # error() looks in it for a mistyped flag
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        match = _INVALID_CHOICE.search(message)
        if match:
            choices = [str(c) for action in self._actions if action.choices for c in action.choices]
            message = message.replace(match.group(0), match.group(0) + did_you_mean(match.group(1), choices), 1)
        elif message.startswith("the following arguments are required"):
            # argparse checks required flags before it lists unknown ones, so `--date x` for `--data x`
            # would only say that --data is missing: name the mistyped flag too
            message += self._mistyped_flag()
        # argv may hold bytes that were not UTF-8 (lone surrogates): quoted, they must still print
        self.exit(2, f"{self.prog}: error: {printable(message)}\n(see `{self.prog} --help`)\n")

    def _mistyped_flag(self) -> str:
        """``"; unrecognized argument --date; did you mean '--data'?"`` for the first flag in the
        arguments that is no option of this parser nor an abbreviation of one, else ``""``."""
        options = [s for action in self._actions for s in action.option_strings]
        for arg in getattr(self, "_argv", []):
            flag = arg.split("=", 1)[0]
            if not flag.startswith("--") or flag == "--":
                continue
            if flag not in options and not any(o.startswith(flag) for o in options):
                return f"; unrecognized argument {flag}{did_you_mean(flag, options)}"
        return ""

    def unrecognized(self, extras: Sequence[str]) -> NoReturn:
        options = [s for action in self._actions for s in action.option_strings]
        flag = next((e.split("=", 1)[0] for e in extras if e.startswith("-")), None)
        hint = did_you_mean(flag, options) if flag else ""
        self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")


def build_parser(commands: Optional[Iterable[str]] = None) -> Parser:
    """The parser with the full options of ``commands`` (default: all of them); the other
    commands are listed by their summary only."""
    full = set(COMMANDS if commands is None else commands)
    parser = Parser(
        prog="lucidlm",
        formatter_class=CommandListFormatter,
        description="A glass-box toolkit for decoder-only transformer language models: run, chat with, "
                    "train, fine-tune, score and look inside LLMs. With no --model, commands use the embedded "
                    "SmolLM2-135M-Instruct.",
    )
    from lucidlm import __version__
    parser.add_argument("--version", action="version", version=f"lucidlm {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        if name in full:
            importlib.import_module(f"lucidlm.commands.{name}").register(subparsers)
        else:
            subparsers.add_parser(name, help=SUMMARIES.get(name), add_help=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    as_program = argv is None  # run as ``lucidlm`` / ``python -m lucidlm``, not called by Python code
    if as_program:
        _stand_in_for_closed_streams()
    argv = list(sys.argv[1:] if argv is None else argv)
    # The top-level parser has no option that takes a value, so the first word is the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        parser = build_parser([command] if command in COMMANDS else [])
    except ModuleNotFoundError as exc:  # registering a command imports its modules (torch, numpy, ...)
        if _said_missing_dependency(command, exc):
            return 1
        raise
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subparser(parser, args.command).unrecognized(extras)
    code = _run(args)
    # not under a profiler or tracer (cProfile, coverage): they write their results after main returns
    if as_program and args.command in FAST_EXIT and sys.getprofile() is None and sys.gettrace() is None:
        _leave_now(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        with _stdout_errors_named():
            code = int(args.handler(args) or 0)
            sys.stdout.flush()  # what is still buffered fails here, not in the interpreter's teardown
        return code
    except LucidLMError as exc:
        print(f"lucidlm {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nlucidlm {args.command}: interrupted.", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `lucidlm generate ... | head` closes the pipe early
        if args.command not in LOG_ON_STDOUT:
            return 0
        try:  # train's stdout is a log: the run stopped unfinished and unsaved, which is no success
            print(f"lucidlm {args.command}: stopped: stdout was closed (the program reading it exited); the "
                  f"run was not finished or saved.", file=sys.stderr)
        except BrokenPipeError:  # `2>&1 | head`: stderr went with it
            pass
        return 141  # 128 + SIGPIPE: what a shell reports for a program a closed pipe ends
    except Exception as exc:  # noqa: BLE001 - the last resort: a bug, not bad input
        if os.environ.get("LUCIDLM_DEBUG"):
            raise
        if _said_missing_dependency(args.command, exc):  # a broken install, not a bug to report
            return 1
        print(f"lucidlm {args.command}: {INTERNAL_ERROR} ({type(exc).__name__}: {exc}). This is a bug in "
              f"lucidlm: run again with LUCIDLM_DEBUG=1 for the traceback and report it.", file=sys.stderr)
        return 70  # EX_SOFTWARE


def _said_missing_dependency(command: Optional[str], exc: BaseException) -> bool:
    """Say which of lucidlm's dependencies ``exc`` found missing and how to install it (a
    `pip install --no-deps lucidlm`); False, saying nothing, when it is no such error."""
    missing = _missing_dependency(exc)
    if missing and _installed(exc.name.split(".")[0]):  # a part of it is missing: a broken or mismatched install
        print(f"lucidlm {command}: error: {exc} (a part of lucidlm's dependency {missing!r}, which is installed "
              f"but broken or of another version). Reinstall it with: pip install --force-reinstall '{missing}'",
              file=sys.stderr)
    elif missing:
        print(f"lucidlm {command}: error: lucidlm needs the package {missing!r}, which is not installed. "
              f"Install it with: pip install '{missing}'", file=sys.stderr)
    return missing is not None


def _installed(module: str) -> bool:
    """Whether top-level ``module`` can be found: "No module named 'numpy._core'" (a pickle from
    numpy 2 read by numpy 1) or 'regex._main' names a part of a package that is there, and
    `pip install` of it would only say it is already satisfied."""
    from importlib.util import find_spec

    try:
        return find_spec(module) is not None  # None too where sys.modules holds None for it
    except (ImportError, ValueError):
        return False


def _missing_dependency(exc: BaseException) -> Optional[str]:
    """The requirement of lucidlm's (``"regex"``, ``"jinja2>=3.1"``, as pyproject.toml declares it)
    whose module ``exc`` failed to import; None for anything else."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return None
    from importlib.metadata import PackageNotFoundError, requires

    try:
        declared = requires("lucidlm") or []
    except PackageNotFoundError:  # run from a checkout that was never installed: nothing declared
        return None
    module = exc.name.split(".")[0].lower()
    for requirement in declared:
        name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
        if "extra ==" not in requirement and name.lower().replace("-", "_") == module:
            return requirement
    return None


class _NamedStdout:
    """``sys.stdout`` whose failed writes (a full disk, an I/O error; not a closed pipe, which
    ends the command quietly) raise one ``OutputError`` naming stdout, not an OSError that
    would read as a bug in lucidlm."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with self._named():
            try:
                return self._stream.write(text)
            except UnicodeEncodeError:  # PYTHONIOENCODING=ascii, a Latin-1 locale: escape what it lacks
                encoding = self._stream.encoding  # (as Python writes stderr) instead of an internal error
                return self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))

    def flush(self) -> None:
        with self._named():
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # isatty, encoding, buffer, fileno, ...: the stream's own
        return getattr(self._stream, name)

    @contextmanager
    def _named(self) -> Iterator[None]:
        try:
            yield
        except (BrokenPipeError, OutputError):
            raise
        except OSError as exc:
            raise OutputError(f"cannot write to stdout: {exc.strerror or exc}; free space, or send the output "
                              f"elsewhere.") from None


@contextmanager
def _stdout_errors_named() -> Iterator[None]:
    real = sys.stdout
    named = sys.stdout = _NamedStdout(real)
    try:
        yield
    finally:
        if sys.stdout is named:  # unless the command put its own in place meanwhile
            sys.stdout = real


class _ClosedStream(io.TextIOBase):
    """A standard stream the program was started without (``<&-``, ``>&-``, some daemons), where
    Python leaves None: reading stdin or writing stdout is one lucidlm error naming it, not an
    AttributeError in whatever touched it first. What goes to a closed stderr goes nowhere
    (``print(file=None)`` would put it on stdout, into the output); the exit status still tells."""

    def __init__(self, name: str) -> None:
        self.name = name

    def isatty(self) -> bool:
        return False

    def read(self, size: Optional[int] = -1) -> str:
        raise InputError(f"cannot read {self.name}: it is closed (the program was started with <&-); give it "
                         f"input, e.g. < FILE or < /dev/null.")

    readline = read  # type: ignore[assignment]

    def write(self, text: str) -> int:
        if self.name == "stderr":
            return len(text)
        raise OutputError(f"cannot write to {self.name}: it is closed (the program was started with >&-); send "
                          f"the output somewhere, e.g. > FILE or > /dev/null.")


def _stand_in_for_closed_streams() -> None:
    for name in ("stdin", "stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, _ClosedStream(name))


def _leave_now(code: int) -> NoReturn:
    """Flush the output and end the process at once. Tearing down an interpreter that imported
    torch (clearing ~170k objects and thousands of modules) takes ~0.4 s on 2 cores, a quarter
    of a fresh ``generate``; the command has nothing left to close or write."""
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `lucidlm generate ... | head`: the reader is gone, as in main()
        pass
    try:
        sys.stderr.flush()
    except BrokenPipeError:
        pass
    os._exit(code)


def _subparser(parser: Parser, command: str) -> Parser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
