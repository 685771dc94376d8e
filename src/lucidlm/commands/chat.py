"""``lucidlm chat``: an interactive conversation with a chat model, answers streamed.

The prompt follows llama.cpp / ollama habits: line editing and history, ``\"\"\"`` for
multi-line messages, ``/set temperature 0.3``, ``/stats``, ``/save FILE``. When the
conversation outgrows the context, the oldest turns are dropped (never the system prompt).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, TextIO

from lucidlm.commands import arg_types
from lucidlm.commands.chat_input import enable_line_editing, read_message
from lucidlm.commands.generate import (add_draft_arguments, add_model_arguments, add_sampling_arguments, as_typed,
                                      check_draft_flags, load_model_and_draft, sampling_kwargs)
from lucidlm.errors import LucidLMError
from lucidlm.staging import atomic_write_text
from lucidlm.suggest import did_you_mean

HELP_TEXT = "type /help for the commands; /exit or Ctrl-D leaves"
COMMANDS_HELP = """\
  /help                 this list
  /set NAME VALUE       a generation setting: temperature, top_k, top_p, min_p, repetition_penalty,
                        typical_p, epsilon_cutoff, eta_cutoff, no_repeat_ngram_size,
                        suppress_tokens (13,198), bad_words_ids (13;464,3290),
                        logit_bias (13=-100,198=2), sequence_bias (464,3290=-5;13=2),
                        presence_penalty, frequency_penalty,
                        max_new_tokens, seed, draft_tokens (with --draft)
                        (/set temperature 0.3; /set top_p default to unset;
                        /set max_new_tokens default: back to the session's --max-new-tokens)
  /set verbose|quiet    show or hide tokens and tok/s after every answer
  /show                 the settings and the system prompt
  /stats                tokens and speed of the last answer
  /system [TEXT]        a new system prompt (none: the chat template's default); resets the chat
  /reset                forget the conversation
  /save FILE            write the conversation as JSON
  /load FILE            continue a conversation /save wrote (its system prompt, messages and settings)
  /exit                 leave (also Ctrl-D, or Ctrl-C at the prompt)
  \"\"\"                   start and end a message of several lines
Ctrl-C stops an answer."""
SETTINGS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "repetition_penalty": float,
            "typical_p": float, "epsilon_cutoff": float, "eta_cutoff": float, "no_repeat_ngram_size": int,
            "suppress_tokens": arg_types.token_ids, "bad_words_ids": arg_types.token_sequences,
            "logit_bias": arg_types.logit_biases, "sequence_bias": arg_types.sequence_biases,
            "presence_penalty": float, "frequency_penalty": float,
            "max_new_tokens": int, "seed": int, "draft_tokens": int}
ALIASES = {"temp": "temperature", "num_predict": "max_new_tokens", "repeat_penalty": "repetition_penalty"}


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "chat",
        help="chat with a model in the terminal (streams its answers)",
        description="An interactive chat using the model's chat template. With no --model, uses the embedded "
                    "SmolLM2-135M-Instruct. On a terminal: line editing and history (kept across sessions), "
                    '""" ... """ for several lines, /help for the commands (/set temperature 0.3, /stats, '
                    "/save FILE, /system, /reset). Ctrl-C stops an answer; Ctrl-C at the prompt or Ctrl-D "
                    "exits. Reads one message per line when stdin is not a terminal.",
        formatter_class=arg_types.HelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--system", metavar="TEXT", default=None, type=arg_types.text,
                        help="system prompt (default: the chat template's own, if it has one)")
    parser.add_argument("--verbose", action="store_true", help="show tokens and tok/s after every answer")
    add_sampling_arguments(parser, default_max_new_tokens=256)
    add_draft_arguments(parser)
    parser.set_defaults(handler=run_chat)


def run_chat(args: argparse.Namespace) -> int:
    kwargs = sampling_kwargs(args)
    check_draft_flags(args)
    model = load_model_and_draft(args, kwargs)
    from lucidlm.generation.chat_template import check_chat_template

    check_chat_template(model.tokenizer, args.system)  # a model that cannot chat is refused before the session
    interactive = sys.stdin.isatty()
    if callable(getattr(sys.stdin, "reconfigure", None)):
        # A byte that is not UTF-8 arrives as a lone surrogate (as under the C.UTF-8 locale), which
        # answer() names; with strict decoding (e.g. en_US.UTF-8) input() would raise instead.
        sys.stdin.reconfigure(errors="surrogateescape")
    save_history = enable_line_editing() if interactive else (lambda: None)
    try:
        return chat_loop(model, kwargs, system=args.system, title=_describe(args.model, model),
                         verbose=args.verbose, interactive=interactive)
    finally:
        save_history()


class ChatSession:
    """The REPL's state: the conversation, the settings, the last answer's numbers."""

    def __init__(self, model: Any, gen_kwargs: dict[str, Any], system: Optional[str], out: TextIO,
                 verbose: bool) -> None:
        from lucidlm.chat import Conversation

        self.model = model
        self.settings = dict(gen_kwargs)
        self.startup = dict(gen_kwargs)  # what `/set NAME default` puts back where None means nothing
        self.convo = Conversation(system=system)
        self.out = out
        self.verbose = verbose
        self.stats: Optional[str] = None
        self.compile_pending = bool(getattr(model, "compiled", False))  # the first answer waits on torch.compile

    def say(self, text: str) -> None:
        self.out.write(text + "\n")
        self.out.flush()

    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        command, _, rest = line.partition(" ")
        rest = rest.strip()
        if command in ("/exit", "/quit", "/bye"):
            return False
        if command in ("/help", "/?"):
            self.say(COMMANDS_HELP)
        elif command == "/reset":
            self.convo.reset()
            self.say("(conversation reset)")
        elif command == "/system":
            problem = _not_utf8(rest)
            if problem:
                self.say(f"error: the system prompt {problem}")
                return True
            self.convo.reset(system=rest or None, keep_system=False)
            self.say("(system prompt set; conversation reset)" if rest else
                     "(system prompt back to the chat template's default; conversation reset)")
        elif command == "/set":
            self.set(rest)
        elif command == "/show":
            self.say(f"settings: {self.effective_settings()}\nsystem prompt: "
                     + (repr(self.convo.system) if self.convo.system else "the chat template's default"))
        elif command == "/stats":
            self.say(self.stats or "(no answer yet)")
        elif command == "/save":
            self.save(rest)
        elif command == "/load":
            self.load(rest)
        else:
            known = ["/help", "/set", "/show", "/stats", "/system", "/reset", "/save", "/load", "/exit"]
            self.say(f"unknown command {command!r}{did_you_mean(command, known)}; {HELP_TEXT}")
        return True

    def set(self, rest: str) -> None:
        words = rest.split()
        if words[:1] == ["parameter"]:  # ollama's spelling: /set parameter temperature 0.3
            words = words[1:]
        if words in (["verbose"], ["quiet"]):
            self.verbose = words[0] == "verbose"
            self.say(f"(verbose {'on' if self.verbose else 'off'})")
            return
        if len(words) != 2:
            self.say("usage: /set NAME VALUE, e.g. /set temperature 0.3 (/help lists the names)")
            return
        name = words[0].lower().replace("-", "_")
        name = ALIASES.get(name, name)
        if name not in SETTINGS:
            self.say(f"unknown setting {words[0]!r}{did_you_mean(name, SETTINGS)}; "
                     f"settings: {', '.join(SETTINGS)}")
            return
        default = words[1].lower() in ("default", "none")
        typed = f"/set {' '.join(words)}"  # what the user typed names the setting in an error, alias and all
        if name == "draft_tokens" and self.settings.get("draft") is None:  # (the API's words name draft=)
            self.say(f"{typed} needs speculative decoding: start the chat with --draft prompt (prompt lookup) or "
                     f"--draft SOURCE (a draft model).")
            return
        try:
            # max_new_tokens has no "unset" (None): its default is the session's --max-new-tokens
            value = (self.startup.get(name) if name == "max_new_tokens" else None) if default else \
                SETTINGS[name](words[1])
        except ValueError as exc:  # int() and float() say "invalid literal"; the token-list readers say what is wrong
            reason = f"expected {'a whole' if SETTINGS[name] is int else 'a'} number." \
                if SETTINGS[name] in (int, float) else str(exc)
            self.say(f"{typed} is invalid: {reason}")
            return
        try:
            self.check_settings({**self.settings, name: value})
        except ValueError as exc:  # GenerationError is a ValueError too
            self.say(as_typed(str(exc), name, value, typed))
            return
        self.settings[name] = value
        shown = "the model default" if value is None else f"{value}, the session's default" if default else value
        if name == "seed" and value is None:  # no model sets a seed: unset is fresh randomness
            shown = "none: each answer draws afresh"
        if name == "draft_tokens" and value is None:  # lucidlm's own default, not one a model's files give
            from lucidlm.generation.speculative import DEFAULT_DRAFT_TOKENS

            shown = f"{DEFAULT_DRAFT_TOKENS}, the default"
        self.say(f"({name} = {shown})")

    def check_settings(self, settings: dict[str, Any]) -> None:
        """Refuse settings as generate() would: by the options' own checks, and the token ids they
        name against this model's vocabulary (kept, an id past it would fail every later answer,
        whatever /reset does)."""
        from lucidlm.generation.request import make_request

        make_request(dict(settings)).use_model(self.model)

    def effective_settings(self) -> str:
        from lucidlm.generation.defaults import apply_sampling_defaults

        values = apply_sampling_defaults(self.model, self.settings)
        if values.get("draft") is not None and not isinstance(values["draft"], str):
            values["draft"] = "a draft model"  # not its repr
        return ", ".join(f"{k} {v}" for k, v in values.items() if v is not None and k != "stop")

    def save(self, path: str) -> None:
        if not path:
            self.say("usage: /save FILE")
            return
        data = {"system": self.convo.system, "messages": self.convo.messages,  # --draft is the session's, as --model
                "settings": {k: v for k, v in self.settings.items() if v is not None and k != "draft"}}
        try:  # through a staging file: a failed write (full disk) leaves an earlier save whole
            atomic_write_text(Path(path).expanduser(), json.dumps(data, ensure_ascii=False, indent=2) + "\n")
        except OSError as exc:
            self.say(f"cannot write {path}: {exc.strerror or exc}")
            return
        self.say(f"(saved {len(data['messages'])} messages to {path}; /load {path} continues it)")

    def load(self, path: str) -> None:
        """Continue a conversation ``/save`` wrote: its system prompt, turns and settings."""
        from lucidlm.generation.chat_template import check_messages
        from lucidlm.validation import read_json_object

        if not path:
            self.say("usage: /load FILE")
            return
        fix = "load a file that /save wrote"
        try:
            fields = read_json_object(Path(path).expanduser(), LucidLMError, "saved chat", fix)
            messages = fields.list("messages", item=dict)
            check_messages(messages)
            system = fields.str("system", default=None)
            settings = fields.object("settings", default={}).data
            # The draft is the session's, as the model is (/save leaves it out): a "draft" a file
            # names is left out. A chat saved with --draft keeps its draft_tokens: meaningless
            # without one, and refused (draft_tokens needs a draft), it would keep the whole
            # conversation from loading into a chat started without --draft.
            named_draft = "draft" in settings
            unused = settings.get("draft_tokens") if self.settings.get("draft") is None else None
            settings = {k: v for k, v in settings.items()
                        if k != "draft" and not (k == "draft_tokens" and unused is not None)}
            self.check_settings({**self.settings, **settings})  # unknown names and bad values refused by name
        except (LucidLMError, ValueError) as exc:  # GenerationError is a ValueError too
            self.say(f"cannot load {path}: {exc}")
            return
        turns = [m for m in messages if m["role"] != "system"]
        self.convo.reset(system=system, keep_system=False)
        self.convo.history.extend(turns)
        self.settings.update(settings)
        left_out = f"; draft_tokens {unused} left out: this chat has no --draft" if unused is not None else ""
        if named_draft:
            left_out += "; its draft left out: a chat drafts with its own --draft"
        self.say(f"(loaded {len(turns)} messages from {path}{'; system prompt set' if system else ''}{left_out})")

    def answer(self, text: str) -> None:
        convo, out = self.convo, self.out
        problem = _not_utf8(text)
        if problem:  # before the chat template: the position is the one in what was typed
            self.say(f"error: the message {problem}")
            return
        convo.add_user(text)
        limit = self.model.config.max_seq_len
        reserve = min(int(self.settings.get("max_new_tokens") or 64), limit // 4)
        try:
            dropped = convo.fit_context(self.model, reserve)
        except LucidLMError as exc:  # a message longer than the context on its own: refused, nothing dropped
            convo.history.pop()
            self.say(f"error: {exc}")
            return
        if dropped:
            self.say(f"(the conversation outgrew the context of {limit} tokens: dropped the {dropped} oldest "
                     f"messages{'; the system prompt stays' if convo.system else ''})")
        start = time.perf_counter()
        first: Optional[float] = None  # when the first piece came: the prompt pass is done by then
        stopped = False
        try:
            with closing(convo.reply(self.model, steady=True, **self.settings)) as pieces:  # printed, nothing else
                shown: Iterable[str] = pieces
                if self.compile_pending:
                    from lucidlm.commands.loading_status import first_piece_announced
                    shown, self.compile_pending = first_piece_announced(pieces), False
                for piece in shown:
                    first = first or time.perf_counter()
                    out.write(piece)
                    out.flush()
        except KeyboardInterrupt:  # stop this answer, keep the session
            out.write(" [stopped]")
            stopped = True
        except LucidLMError as exc:  # e.g. one message longer than the context: say so, carry on
            convo.history.pop()  # the unanswered user message
            if convo.history and convo.history[-1]["role"] == "user":
                convo.history.pop()
            out.write(f"error: {exc} (type /reset to start over)")
        out.write("\n")
        result = convo.last_result
        if stopped:
            self.stats = f"(the last answer was stopped after {time.perf_counter() - start:.2f} s)"
        elif result is not None:
            self.stats = _stats(result, start, first, time.perf_counter())
            if self.verbose:
                out.write(self.stats + "\n")
        out.flush()


def _not_utf8(text: str) -> Optional[str]:
    """What is wrong with text holding a byte that was not UTF-8 (stdin decodes it to a lone
    surrogate), with the command line's advice, or None when it is fine."""
    try:
        arg_types.text(text)
    except argparse.ArgumentTypeError as exc:
        return str(exc)
    return None


def _stats(result: Any, start: float, first: Optional[float], end: float) -> str:
    """The answer's numbers, its prompt pass apart (ollama's "prompt eval" and "eval" rates): the
    first piece comes once the prompt is read and one token sampled, the others one step each."""
    n, prompt = len(result.token_ids), len(result.prompt_ids)
    cached = getattr(result, "cached_tokens", 0)  # run by an earlier turn: its KV cache was kept (reuse_cache)
    first = first or end
    read = first - start
    rate = f"{(n - 1) / (end - first):.1f} tok/s" if n > 1 and end > first else "-"
    kept = f" ({cached} reused from the last turn's cache)" if cached else ""
    drafts = result.speculation
    drafted = f"; drafts: {drafts.accepted} of {drafts.drafted} kept in {drafts.rounds} rounds" if drafts else ""
    return (f"({n} tokens, {rate} after the first; prompt {prompt} tokens{kept} read in {read:.2f} s, "
            f"{(prompt - cached) / read if read > 0 else 0:.0f} tok/s{drafted}; finish: {result.finish_reason})")


def chat_loop(model: Any, gen_kwargs: dict[str, Any], system: Optional[str] = None,
              read_line: Callable[[str], str] = input, out: Optional[TextIO] = None, *,
              title: Optional[str] = None, verbose: bool = False, interactive: Optional[bool] = None) -> int:
    """The REPL. ``read_line`` and ``out`` are parameters so tests can drive it."""
    out = out if out is not None else sys.stdout
    interactive = sys.stdin.isatty() if interactive is None else interactive
    session = ChatSession(model, gen_kwargs, system, out, verbose)
    if interactive:
        session.say(f"lucidlm chat - {title or 'model'}\n{session.effective_settings()}\n{HELP_TEXT}")
    while True:
        try:
            line = read_message(read_line, ">>> " if interactive else "", "... " if interactive else "")
        except EOFError:  # Ctrl-D, or the end of piped input
            if interactive:
                out.write("\n")
            return 0
        except KeyboardInterrupt:  # Ctrl-C while waiting for input: leave
            out.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and "\n" not in text:
            if not session.command(text):
                return 0
            continue
        session.answer(text)


def _describe(source: str, model: Any) -> str:
    from lucidlm.pretrained import PRETRAINED

    name = PRETRAINED[source].description if source in PRETRAINED else source
    return (f"{name}; {model.num_parameters() / 1e6:.0f}M parameters ({_weights(model)}), "
            f"context {model.config.max_seq_len} tokens, on {model.device}")


def _weights(model: Any) -> str:
    """How the weights are held: "bfloat16 weights", or e.g. "int4/32 layers, bfloat16 embedding"."""
    from lucidlm.quantization import quantization_layout

    float_name = str(model.dtype).removeprefix("torch.")
    layout = {name: _scheme(spec) for name, spec in quantization_layout(model).items()}
    if not layout:
        return f"{float_name} weights"
    layers = sorted({scheme for name, scheme in layout.items() if name not in ("embed", "unembed")})
    return f"{' + '.join(layers) or float_name} layers, {layout.get('embed', float_name)} embedding"


def _scheme(spec: dict) -> str:
    """"int4/32" or "int8 per channel" from a layout entry ({"scheme", "group_size"})."""
    return spec["scheme"] + (f"/{spec['group_size']}" if spec["group_size"] else " per channel")
