"""``lucidlm generate PROMPT``: continue a prompt (or answer it, with --chat)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any, Callable, Iterable, Optional

from lucidlm.commands import arg_types
from lucidlm.errors import GenerationError, InputError, QuantizationError

DTYPES = ("float32", "bfloat16", "float16")
# quantization.SCHEMES and "gguf" (the file's own quants), spelled out: --help must not import torch.
# tests/quantization/test_quantize_choices.py holds the two lists together.
QUANTIZE_CHOICES = ("int8", "int4", "gguf")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "generate",
        help="continue a prompt with a model (KV-cached sampling, beam search, streaming)",
        description="Generate text from PROMPT. With no --model, uses the embedded SmolLM2-135M-Instruct. "
                    "Prints the generated text only (not the prompt).",
        formatter_class=arg_types.HelpFormatter,
        epilog="examples:\n"
               "  lucidlm generate 'Once upon a time' --temperature 0 --max-new-tokens 40\n"
               "  lucidlm generate 'What is the capital of France?' --chat --stream\n"
               "  lucidlm generate 'The' --model gpt2-dir/ --top-p 0.9 --seed 1 --json\n"
               "  cat question.txt | lucidlm generate - --chat --system 'Answer in one sentence.'",
    )
    parser.add_argument("prompt", metavar="PROMPT", type=arg_types.text,
                        help="the text to continue (or the user message with --chat); - reads it from stdin")
    add_model_arguments(parser)
    add_sampling_arguments(parser, default_max_new_tokens=64)
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams (1 = off; "
                        "ignores temperature/top-k/top-p/min-p)")
    parser.add_argument("--length-penalty", type=float, default=1.0,
                        help="beam search: score = sum of log-probs / length ** this (> 0 favours longer outputs)")
    parser.add_argument("--chat", action="store_true",
                        help="wrap PROMPT as a user message in the model's chat template")
    parser.add_argument("--system", metavar="TEXT", default=None, type=arg_types.text,
                        help="with --chat: the system prompt (default: the chat template's own, if it has one)")
    parser.add_argument("--logprobs", metavar="N", type=int, default=None,
                        help="with --json: add each generated token's log-prob (logprobs) and the N most likely "
                             "tokens at each step (top_logprobs: [token_id, logprob] pairs, null for a token a "
                             "sampling filter removed; 0 = none), from the distribution it was sampled from")
    add_draft_arguments(parser)
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true",
                        help='print one JSON object: text, token_ids (generated only), prompt_ids, finish_reason '
                             "(eos|stop|length), prompt_tokens, new_tokens, load_seconds, seconds, "
                             'tokens_per_second (and with --logprobs, logprobs and top_logprobs); with --stream, '
                             'first one {"text": piece} line per piece')
    parser.set_defaults(handler=run_generate)


def add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """--draft and --draft-tokens (speculative decoding), for generate, chat and serve."""
    parser.add_argument("--draft", metavar="prompt|SOURCE", default=None,
                        help="speculative decoding: 'prompt' drafts by prompt lookup (tokens that followed the "
                             "text's last few tokens earlier on; fast when the answer copies the prompt), a model "
                             "SOURCE (as --model; same vocabulary, loaded with its defaults, e.g. smollm2-135m's "
                             "4-bit file) drafts with that model. Same tokens (greedy), same distribution (sampling)")
    parser.add_argument("--draft-tokens", metavar="K", type=int, default=None,
                        help="with --draft: tokens drafted per round, checked in one pass (default 5)")


def add_model_arguments(parser: argparse.ArgumentParser, decodes: bool = True) -> None:
    """--model and the flags of how it loads; ``decodes``: the command generates tokens (adds
    --compile, which compiles the decode step)."""
    parser.add_argument("--model", metavar="SOURCE", default="smollm2-135m",
                        help="model to load: a .gguf file, a Hugging Face or lucidlm model directory, a "
                             "pretrained name (smollm2-135m: the embedded model) or a preset")
    parser.add_argument("--adapter", metavar="DIR", default=None,
                        help="LoRA / prefix-tuning adapter directory to apply")
    parser.add_argument("--random-init", action="store_true",
                        help="--model names an architecture preset (gpt2, llama, ...): build it untrained")
    parser.add_argument("--device", default="auto",
                        help="auto (CUDA if torch sees a GPU, else CPU), cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default=None,
                        help="float weights of this dtype: " + ", ".join(DTYPES) + " (default float32; the "
                             "pretrained models, smollm2-135m and gemma3-270m, load their files' quants unless "
                             "--dtype or --quantize is given)")
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="keep weights as integer codes: int8 (per channel), int4 (groups of "
                             "--group-size, 32 by default), or gguf (a GGUF file's own quantization)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="with --quantize int4 or int8: the group size (int4: 32, 64, 128 or 256, default 32; "
                             "int8: one that divides the layers' widths, default per output channel)")
    parser.add_argument("--float-embeddings", action="store_true",
                        help="with --quantize: keep the token embedding and unembedding float (the embedded "
                             "model's default keeps its file's Q8_0 table instead)")
    if decodes:
        parser.add_argument("--compile", action="store_true",
                            help="torch.compile the decode step (CUDA graphs on a GPU): slower first answer "
                                 "(compiling), faster tokens after it")
    parser.add_argument("-q", "--quiet", action="store_true", help="no loading line on stderr")


def add_sampling_arguments(parser: argparse.ArgumentParser, default_max_new_tokens: int) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=default_max_new_tokens,
                       help="most tokens to generate (fewer if EOS, a stop string or the context end comes first)")
    group.add_argument("--temperature", type=float, default=None,
                       help="softmax temperature; 0 = greedy (always the most likely token). Unset sampling "
                            "options take the model's defaults (SmolLM2: temperature 0.2, top-p 0.5; see "
                            "lucidlm/generation/defaults.py), else temperature 1")
    group.add_argument("--top-k", type=int, default=None, help="sample only among the k most likely tokens")
    group.add_argument("--top-p", type=float, default=None,
                       help="nucleus sampling: the smallest set of tokens with total probability >= p, in (0, 1] "
                            "(1 = off)")
    group.add_argument("--min-p", type=float, default=None,
                       help="drop tokens less likely than min_p x the most likely one, in [0, 1]")
    group.add_argument("--repetition-penalty", type=float, default=None,
                       help="> 1 discourages tokens already in the text (CTRL / HF style)")
    group.add_argument("--typical-p", type=float, default=None,
                       help="locally typical sampling: the tokens whose surprisal is closest to the entropy, as "
                            "few as reach total probability p, in (0, 1] (1 = off)")
    group.add_argument("--epsilon-cutoff", type=float, default=None,
                       help="drop tokens less likely than this, in [0, 1) (0 = off; 3e-4 to 9e-4 is usual)")
    group.add_argument("--eta-cutoff", type=float, default=None,
                       help="drop tokens less likely than min(eta, sqrt(eta) x exp(-entropy)), in [0, 1) "
                            "(0 = off; 3e-4 to 2e-3 is usual)")
    group.add_argument("--no-repeat-ngram-size", type=int, default=None, metavar="N",
                       help="never repeat an n-gram of N tokens of the prompt or output (transformers' "
                            "no_repeat_ngram_size; 0 = off, 2 to 4 is usual); beam search too")
    group.add_argument("--suppress-tokens", type=arg_types.token_ids, default=None, metavar="IDS",
                       help="token ids never generated, separated by commas (e.g. 13,198)")
    group.add_argument("--bad-words-ids", type=arg_types.token_ids, action="append", default=None, metavar="IDS",
                       help="a token id sequence never generated, its ids separated by commas (transformers' "
                            "bad_words_ids; a longer one is banned at its last token); repeatable")
    group.add_argument("--bad-words", action="append", default=None, metavar="TEXT", type=arg_types.text,
                       help="text never generated: its ids as the model's tokenizer encodes it become a "
                            "--bad-words-ids sequence (mind the space: ' Paris' is the word mid-sentence); repeatable")
    group.add_argument("--logit-bias", type=arg_types.logit_bias, action="append", default=None, metavar="ID=BIAS",
                       help="add BIAS to token ID's logit (OpenAI's / llama.cpp's logit_bias; -100 or -inf bans it, "
                            "e.g. 13=-100); repeatable")
    group.add_argument("--sequence-bias", type=arg_types.token_bias, action="append", default=None,
                       metavar="IDS=BIAS", help="add BIAS to the last token of a token id sequence where the rest is "
                                                "there (transformers' sequence_bias, e.g. 464,3290=-5); repeatable")
    group.add_argument("--presence-penalty", type=float, default=None,
                       help="subtract this from the logit of every token already generated (OpenAI's; -2 to 2 is "
                            "its range, 0 = off)")
    group.add_argument("--frequency-penalty", type=float, default=None,
                       help="subtract this times a token's count in the output from its logit (OpenAI's; -2 to 2 "
                            "is its range, 0 = off)")
    group.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT", type=arg_types.text,
                       help="stop when TEXT appears (not included in the output); repeatable")
    group.add_argument("--min-new-tokens", type=int, default=0,
                       help="EOS cannot end the output before this many new tokens")
    group.add_argument("--context-overflow", choices=("stop", "crop"), default="stop",
                       help="at the end of the context window: stop, or crop to its last max_seq_len tokens "
                            "and go on (seed 003's sliding generation; slower, no KV cache past that point)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                typical_p=args.typical_p, epsilon_cutoff=args.epsilon_cutoff, eta_cutoff=args.eta_cutoff,
                no_repeat_ngram_size=args.no_repeat_ngram_size, suppress_tokens=args.suppress_tokens,
                bad_words_ids=args.bad_words_ids, sequence_bias=_pairs(args.sequence_bias),
                logit_bias=_logit_bias(args.logit_bias), presence_penalty=args.presence_penalty,
                frequency_penalty=args.frequency_penalty,
                seed=args.seed, stop=args.stop, min_new_tokens=args.min_new_tokens,
                context_overflow=args.context_overflow)


def _pairs(biases: Optional[list[tuple[list[int], float]]]) -> Optional[list[list]]:
    """--sequence-bias's (ids, bias) pairs as transformers' [[ids, bias], ...]."""
    return None if biases is None else [[ids, bias] for ids, bias in biases]


def _logit_bias(biases: Optional[list[tuple[int, float]]]) -> Optional[dict[int, float]]:
    """--logit-bias's (id, bias) pairs as {id: bias}; a token given twice keeps its last bias."""
    return None if biases is None else dict(biases)


def load_model_from_args(args: argparse.Namespace, options: Optional[dict[str, Any]] = None,
                         checks: Optional[Callable[[], None]] = None) -> Any:
    """The model the flags name. The loading line goes to stderr first, before torch is even
    imported (a spinner follows on a terminal); ``options`` (generation options, a bad one
    named by its flag) and the command's own ``checks`` (which may import torch) run before the
    model loads, so a bad flag or path costs no load. The line comes first, not the checks:
    they need torch, whose import is most of a second, and every good command would wait that
    long in silence to spare a bad one the line."""
    from lucidlm.commands.loading_status import LoadingStatus

    with LoadingStatus(f"loading {args.model}", enabled=not getattr(args, "quiet", False)) as status:
        if options is not None:
            check_sampling_flags(options)
        if checks is not None:
            checks()
        check_quantize_flags(args)
        import lucidlm
        import lucidlm.loading  # noqa: F401 - torch and the model code, before the freeze
        from lucidlm.collector import kept_until_exit

        # torch's ~170k objects, the tokenizer and the module tree live as long as this process:
        # a full collection walked them all, ~0.2 s, once or twice before the first token
        with kept_until_exit():
            model = lucidlm.load(args.model, dtype=args.dtype, device=args.device, adapter=args.adapter,
                                 quantize=getattr(args, "quantize", None),
                                 group_size=getattr(args, "group_size", None),
                                 quantize_embeddings=not getattr(args, "float_embeddings", False),
                                 random_init=getattr(args, "random_init", False),
                                 compile=getattr(args, "compile", False))
        model.eval()
        if options is not None and getattr(args, "bad_words", None):
            options["bad_words_ids"] = [*(options.get("bad_words_ids") or []),
                                        *(_bad_word_ids(model, text) for text in args.bad_words)]
        if options is not None:  # the token ids the flags name are the model's, before chat waits for a line
            from lucidlm.generation.request import make_request
            try:
                make_request(dict(options)).use_model(model)
            except GenerationError as exc:
                raise GenerationError(flags_for_keywords(str(exc), options)) from None
    args.load_seconds = status.seconds
    return model


def check_sampling_flags(options: dict[str, Any]) -> None:
    """Generation options from the flags, checked by the Python API's own rules
    (``check_options``), a bad one named as typed (``--top-p 2``), not as a keyword."""
    from lucidlm.generation import check_options

    try:
        check_options(**options)
    except GenerationError as exc:
        raise flags_named(exc, options) from None


def flags_named(exc: GenerationError, options: dict[str, Any]) -> GenerationError:
    """``exc`` with the flag as typed in place of the option its message begins with (the
    checks' messages do), or ``exc`` itself when it names none."""
    name = str(exc).partition("=")[0]
    if name not in options:
        return exc
    return GenerationError(as_typed(str(exc), name, options[name], _flag_typed(name, options[name])))


def flags_for_keywords(message: str, options: dict[str, Any]) -> str:
    """The Python API's message about the flags' options and the model (``suppress_tokens names
    token id 99999``, ``use suppress_tokens=[2]``) in the command line's words: each option it
    names, with its value where it gives one, as the flag (``--suppress-tokens``,
    ``--suppress-tokens 2``). Only the names with an underscore: a one-word name (stop, seed,
    draft) is also an English word the message may use."""
    import re

    for name in (n for n in options if "_" in n):
        flag = "--" + name.replace("_", "-")  # every generation flag is its option's name
        message = re.sub(rf"(?<![\w-]){name}=\[([\d, ]+)\]", lambda m: f"{flag} {m.group(1).replace(' ', '')}",
                         message)
        message = re.sub(rf"(?<![\w-]){name}(?![\w=])", flag, message)
    return message


def as_typed(message: str, name: str, value: Any, typed: str) -> str:
    """The Python API's message about option ``name`` (``top_p=2.0 is invalid: ...``) with
    ``typed``, what the user wrote (``--top-p 2``, ``/set top_p 2``), in place of the keyword
    (the message as it is if it does not begin with it)."""
    from lucidlm.validation import show_value

    for keyword in (f"{name}={value}", f"{name}={value!r}", f"{name}={show_value(value)}"):  # the checks' spellings
        if message.startswith(keyword + " "):
            return typed + message[len(keyword):]
    return message


def _flag_typed(name: str, value: Any) -> str:
    """The flag of option ``name`` with ``value`` as a command line gives it: ``--top-p 2``."""
    import shlex

    flag = "--" + name.replace("_", "-")  # every generation flag is its option's name
    values = value if isinstance(value, list) else [value]  # --stop, given once per text
    return " ".join(f"{flag} {shlex.quote(v) if isinstance(v, str) else f'{v:g}' if isinstance(v, float) else v}"
                    for v in values)


def _bad_word_ids(model: Any, text: str) -> list[int]:
    """--bad-words TEXT as the ids the model would write for it: its tokenizer's encoding, without
    the BOS token some tokenizers put first (Gemma's)."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise InputError(f"--bad-words {text!r} needs the model's tokenizer to encode it, and this model has none; "
                         f"give its token ids with --bad-words-ids.")
    ids = list(tokenizer.encode(text))
    if ids[:1] == [tokenizer.bos_id] and getattr(tokenizer, "add_bos", False):
        ids = ids[1:]
    if not ids:
        raise InputError(f"--bad-words {text!r} encodes to no token; give a non-empty text.")
    from lucidlm.weights.hf_generation_config import end_token_ids

    if len(ids) == 1 and ids[0] in end_token_ids(model):  # what the API refuses in bad_words_ids, in these words
        raise InputError(f"--bad-words {text!r} is the end token {ids[0]} alone, which transformers' word ban "
                         f"silently leaves possible, so lucidlm refuses it; to forbid it, use --suppress-tokens "
                         f"{ids[0]} (or --min-new-tokens to delay it).")
    return ids


def check_quantize_flags(args: argparse.Namespace) -> None:
    """--group-size and --float-embeddings refused by their flag names when they cannot apply,
    before the model loads (``lucidlm.load``'s own messages name its Python keywords)."""
    quantize, group_size = getattr(args, "quantize", None), getattr(args, "group_size", None)
    if group_size is not None:
        if quantize in (None, "gguf"):  # not a scheme of QUANTIZE_CHOICES: refused before torch is imported
            given = (f"not --quantize {quantize}, which keeps the file's own groups" if quantize else
                     "which is not given")
            raise QuantizationError(f"--group-size {group_size} only applies with --quantize int4 or int8 ({given}); "
                                    f"add --quantize int4 (or int8), or drop --group-size.")
        from lucidlm.quantization import SCHEMES
        from lucidlm.quantization.base import check_group_size_value

        check_group_size_value(group_size, "--group-size")

        allowed = SCHEMES[quantize].group_sizes
        if allowed and group_size not in allowed:
            raise QuantizationError(f"--group-size {group_size}: --quantize {quantize} takes groups of "
                                    f"{', '.join(map(str, allowed))} (the sizes its CPU kernels run); use one of "
                                    f"those.")
    if getattr(args, "float_embeddings", False) and quantize is None:
        raise QuantizationError("--float-embeddings keeps the embeddings float beside --quantize's quantized layers; "
                                "without --quantize every weight is float already: add --quantize (gguf, int8 or "
                                "int4), or drop --float-embeddings.")


def read_prompt(prompt: str) -> str:
    """PROMPT as given, or all of stdin for ``-`` (one trailing newline dropped)."""
    if prompt != "-":
        return prompt
    if sys.stdin.isatty():  # typed, not piped: without a word the command looks hung (nothing loads until EOF)
        print("reading the prompt from the terminal; end it with Ctrl-D on a line of its own", file=sys.stderr,
              flush=True)
    data = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode("utf-8")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"PROMPT - (stdin) is not UTF-8 text: byte 0x{data[exc.start]:02x} at byte {exc.start} "
                         f"cannot be decoded; pipe UTF-8 text (e.g. convert it with iconv -t UTF-8).") from None
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # what reading stdin as text did (universal newlines)
    return text[:-1] if text.endswith("\n") else text


def check_draft_source(draft: Optional[str]) -> None:
    """--draft names prompt, a pretrained model or a path that exists: checked before the model
    loads (a missing draft failed only after the whole model had loaded, in words about loading
    that did not say which flag)."""
    if draft is not None and draft != "prompt":
        check_second_model(draft, "--draft", "give a draft model's path, or --draft prompt (prompt lookup)")


def check_second_model(source: str, flag: str, fix: str) -> None:
    """A flag naming a model besides --model (a draft, a base to compare with) names a pretrained
    model or a path that exists, checked before either loads."""
    from pathlib import Path

    from lucidlm.pretrained import PRETRAINED

    if source not in PRETRAINED and not Path(source).expanduser().exists():
        raise InputError(f"{flag} {source}: no such file or directory, and not a pretrained model "
                         f"({', '.join(sorted(PRETRAINED))}); {fix}.")


def check_draft_flags(args: argparse.Namespace) -> None:
    """--draft's companions, before the model loads: generate() refuses a draft with beams or with
    crop only once the model has (in its keywords: draft=..., num_beams=1), and chat every turn."""
    if args.draft_tokens is not None and args.draft is None:
        raise InputError(f"--draft-tokens {args.draft_tokens} needs --draft (prompt, or a draft model).")
    if args.draft is not None and getattr(args, "num_beams", 1) > 1:
        raise InputError(f"--draft (speculative decoding) does not work with beam search (--num-beams "
                         f"{args.num_beams}); drop one of them.")
    if args.draft is not None and getattr(args, "context_overflow", "stop") == "crop":
        raise InputError("--draft (speculative decoding) does not work with --context-overflow crop; drop one of "
                         "them (--context-overflow stop is the default).")


def load_model_and_draft(args: argparse.Namespace, kwargs: dict[str, Any]) -> Any:
    """The model, as ``load_model_from_args`` loads it (``kwargs``, the generation options, checked
    against it, with --bad-words as its tokenizer encodes them), and with --draft the draft in
    ``kwargs``: "prompt", or the draft model, loaded once the model has."""
    drafted = dict(draft=None if args.draft is None else "prompt", draft_tokens=args.draft_tokens)
    options = {**kwargs, **drafted}  # a draft model: "prompt" here; its path is checked by check_draft_source
    model = load_model_from_args(args, options, checks=lambda: check_draft_source(args.draft))
    if "bad_words_ids" in options:  # with --bad-words TEXT as the loaded tokenizer encodes it
        kwargs["bad_words_ids"] = options["bad_words_ids"]
    if args.draft is not None:
        kwargs.update(drafted)
        if args.draft != "prompt":
            import lucidlm

            from lucidlm.generation.speculative import check_draft

            kwargs["draft"] = draft = lucidlm.load(args.draft, device=args.device).eval()
            try:  # a draft of another vocabulary: said now, not at generate's (chat's every turn's) first token
                check_draft(model, draft)
            except GenerationError as exc:
                reason = str(exc).replace("draft='prompt'", "--draft prompt")
                raise InputError(f"--draft {args.draft}: {reason}") from None
    return model


def run_generate(args: argparse.Namespace) -> int:
    kwargs = dict(sampling_kwargs(args), num_beams=args.num_beams, length_penalty=args.length_penalty,
                  logprobs=args.logprobs)
    if args.logprobs is not None and not args.json:
        raise InputError(f"--logprobs {args.logprobs} is printed with the --json output; add --json.")
    if args.logprobs is not None:  # generate()'s own error offers True / False / None, which no flag can give
        from lucidlm.validation import check_int

        check_int(args.logprobs, "--logprobs", InputError, low=0,
                  fix="0 adds each token's log-prob, N also the N most likely tokens at each step")
    if args.system is not None and not args.chat:
        raise InputError("--system needs --chat (a system prompt is part of the chat template).")
    if args.context_overflow == "crop" and args.num_beams > 1:  # generate() says so only once the model has loaded
        raise InputError(f"--context-overflow crop works with sampling and greedy decoding, not beam search "
                         f"(--num-beams {args.num_beams}); drop one of them.")
    if args.length_penalty != 1.0 and args.num_beams == 1:
        raise InputError(f"--length-penalty {args.length_penalty:g} scores beam search's hypotheses; add "
                         f"--num-beams N (N > 1), or drop --length-penalty.")
    check_draft_flags(args)
    prompt = read_prompt(args.prompt)
    model = load_model_and_draft(args, kwargs)
    if model.tokenizer is None:
        raise GenerationError(f"model {args.model!r} has no tokenizer, so it cannot read a text prompt; "
                              f"use a model directory or GGUF file that includes one.")
    if args.chat:
        from lucidlm.generation.chat_template import encode_chat

        system = [{"role": "system", "content": args.system}] if args.system else []
        prompt = encode_chat(model.tokenizer, system + [{"role": "user", "content": prompt}],
                             context=None if args.context_overflow == "crop" else model.config.max_seq_len)
    from lucidlm.generation import stream

    start = time.perf_counter()
    try:  # checks that need the model (more beams than its vocabulary) name the flags too
        pieces = stream(model, prompt, steady=True, **kwargs)  # the loop below only prints
    except GenerationError as exc:
        raise flags_named(exc, kwargs) from None
    shown: Iterable[str] = pieces
    if model.compiled:  # the first token waits on torch.compile: say so instead of looking hung
        from lucidlm.commands.loading_status import first_piece_announced
        shown = first_piece_announced(pieces, enabled=not getattr(args, "quiet", False))
    for piece in shown:
        if args.json and args.stream:
            print(_json_line({"text": piece}), flush=True)
        elif args.stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    seconds = time.perf_counter() - start
    result = pieces.result
    if args.json:
        print(_json_line(_json_result(result, getattr(args, "load_seconds", 0.0), seconds)))
    elif args.stream:
        sys.stdout.write("\n")
    else:
        print(result.text)
    return 0


def _json_line(data: dict[str, Any]) -> str:
    """``data`` as one line of JSON: text as it is on a UTF-8 stdout, \\u escapes on any other
    (PYTHONIOENCODING=ascii, a Latin-1 locale), where the stream would escape the characters it
    lacks as Python does (\\U0001f600 for an emoji), which is not JSON."""
    import codecs

    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    return json.dumps(data, ensure_ascii=not codecs.lookup(encoding).name.startswith("utf-"))


def _json_result(result: Any, load_seconds: float, seconds: float) -> dict[str, Any]:
    """The ``--json`` line. ``seconds`` is the result's own generation time
    (``GenerationResult.seconds``: the prompt pass and every token, not the printing), the
    wall time measured around the loop where a result has none."""
    new_tokens = len(result.token_ids)
    seconds = result.seconds if getattr(result, "seconds", None) is not None else seconds
    scores = {}
    if getattr(result, "logprobs", None) is not None:  # asked for (--logprobs)
        scores["logprobs"] = [_json_number(value) for value in result.logprobs]
        if result.top_logprobs is not None:
            scores["top_logprobs"] = [[[token, _json_number(value)] for token, value in step]
                                      for step in result.top_logprobs]
    return {"text": result.text, "token_ids": result.token_ids, "prompt_ids": result.prompt_ids,
            "finish_reason": result.finish_reason, "prompt_tokens": len(result.prompt_ids),
            "new_tokens": new_tokens, "load_seconds": round(load_seconds, 4), "seconds": round(seconds, 4),
            "tokens_per_second": round(new_tokens / seconds, 2) if seconds > 0 else None} | scores | \
        _json_speculation(getattr(result, "speculation", None))


def _json_speculation(stats: Any) -> dict[str, Any]:
    """With --draft: how many drafted tokens the model kept (``speculative.SpeculationStats``)."""
    if stats is None:
        return {}
    return {"draft_rounds": stats.rounds, "drafted_tokens": stats.drafted, "accepted_tokens": stats.accepted}


def _json_number(value: float) -> Optional[float]:
    """A number for JSON: -inf (a token the sampler's filters removed), inf (a diverged model's
    perplexity) or NaN is null, as JSON has none of them (json.dumps would write -Infinity,
    which JSON parsers refuse)."""
    return value if math.isfinite(value) else None
