"""Hostile chat templates: each one ends quickly, small, as one ChatTemplateError line naming the
model file; broken tokenizer_config.json files are one TokenizerError line naming the file.

Most cases render through the Python API (milliseconds each); a few go through
``lucidlm generate --chat`` and ``lucidlm chat`` with a tiny GGUF or Hugging Face directory
whose template is hostile, to prove the CLI says one line and never hangs."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import pytest
from harness import api_refused, refused

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
from test_gguf import tiny_weights, to_gguf_layout, write_llama_gguf  # noqa: E402

from lucidlm.chat import CHATML_TEMPLATE, render_chat  # noqa: E402
from lucidlm.errors import ChatTemplateError, TokenizerError  # noqa: E402
from lucidlm.generation import template_sandbox  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
SOURCE = "/models/evil.gguf (tokenizer.chat_template)"
BIG = template_sandbox.MAX_CHARS

# (template, regex the one-line error must match): each would hang, allocate GBs, recurse
# without end or raise a bare exception without the sandbox's limits.
HOSTILE = {
    "nested loops 1e10": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
                          r"ran for more than"),
    "exponential macro": ("{% macro f(n) %}{% if n < 60 %}{{ f(n+1) }}{{ f(n+1) }}{% endif %}{% endmacro %}{{ f(0) }}",
                          r"ran for more than"),
    "recursive loop forever": ("{% for i in [1] recursive %}{{ loop([1]) }}{% endfor %}", r"nests calls more than"),
    "string times 1e9": ("{{ 'a' * 10**9 }}", r"repeated string"),
    "literal times 1e9": ("{{ 'a' * 1000000000 }}", r"repeated string"),
    "list times 1e9": ("{{ (messages * 1000000000)|length }}", r"repeated string or list"),
    "huge power": ("{{ 10 ** 100000000 }}", r"number of more than"),
    "integer squaring": ("{% set ns = namespace(n=3) %}{% for i in range(64) %}{% set ns.n = ns.n * ns.n %}"
                         "{% endfor %}{{ ns.n }}", r"number of more than"),
    "doubling with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}{{ ns.s }}", r"joined string"),
    "doubling with +": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}{{ ns.s }}", r"joined string"),
    "shared list tree": ("{% set ns = namespace(s='abc') %}{% for i in range(80) %}{% set ns.s = [ns.s, ns.s] %}"
                         "{% endfor %}{{ ns.s }}", r"more than"),
    "output loop": ("{% set s = 'a' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}", r"an output of"),
    "macro body loop": ("{% macro m() %}{% set s = 'a' * 1000000 %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                        "{% endmacro %}{{ m()|length }}", r"an output of"),
    "set block loop": ("{% set s = 'a' * 1000000 %}{% set t %}{% for i in range(100000) %}{{ s }}{% endfor %}"
                       "{% endset %}{{ t|length }}", r"an output of"),
    "join of repeats": ("{% set s = 'a' * 100000 %}{{ ([s] * 1000)|join }}", r"more than"),
    "center filter": ("{{ 'a'|center(1000000000) }}", r"'center' filter"),
    "indent filter": ("{{ 'a\nb'|indent(1000000000) }}", r"'indent' filter"),
    "replace filter": ("{% set s = 'a' * 100000 %}{{ s|replace('a', s) }}", r"'replace' filter"),
    "wordwrap filter": ("{{ ('a b ' * 100000)|wordwrap(1, wrapstring='x' * 1000) }}", r"'wordwrap' filter"),
    "format filter width": ("{{ '%01000000000d'|format(1) }}", r"%-format width of 1000000000"),
    "format filter star": ("{{ '%0*d'|format(10**9, 1) }}", r"taken from its arguments"),
    "percent operator": ("{{ '%01000000000d' % 1 }}", r"%-format width"),
    "str.center": ("{{ 'a'.center(10**9) }}", r"width in \.center\(\)"),
    "str.zfill": ("{{ '1'.zfill(10**9) }}", r"width in \.zfill\(\)"),
    "str.expandtabs": ("{{ ('\t' * 100000).expandtabs(100000) }}", r"expanded string"),
    "str.replace": ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", r"\.replace\(\)"),
    "str.join": ("{% set s = 'a' * 100000 %}{{ s.join(range(300)|map('string')) }}", r"\.join\(\)"),
    "str.format repeated field": ("{% set s = 'a' * 1000000 %}{{ ('{0}' * 100).format(s) }}", r"formatted string"),
    "percent repeated key": ("{% set s = 'a' * 1000000 %}{{ ('%(a)s' * 100) % {'a': s} }}", r"%-formatted string"),
    "join filter long separator": ("{{ range(100000)|join('x' * 1000) }}", r"'join' filter"),
    "str.translate": ("{{ ('a' * 100000).translate({97: 'b' * 100000}) }}", r"\.translate\(\)"),
    "str.format width": ("{{ '{:>1000000000}'.format(1) }}", r"format width of 1000000000"),
    "str.format nested width": ("{{ '{:>{w}}'.format(1, w=10**9) }}", r"nested"),
    "slice generator": ("{{ (messages|slice(1000000000)|list)|length }}", r"more than 131072 items|ran for more than"),
    "recursive macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"nests calls more than 64"),
    "division by zero": ("{{ messages|length / 0 }}", r"divides by zero"),
    "modulo by zero": ("{{ 7 % 0 }}", r"divides by zero"),
    "range limit": ("{% for i in range(10**9) %}{% endfor %}", r"OverflowError: Range too big"),
    "tojson huge indent": ("{{ messages|tojson(indent=10**9) }}", r"tojson with indent=1000000000"),
    "tojson bad separators": ("{{ messages|tojson(separators=5) }}", r"tojson with separators=5"),
    "tojson of a function": ("{{ raise_exception|tojson }}", r"tojson on a value JSON cannot hold"),
    "tojson bad keyword": ("{{ messages|tojson(colour=1) }}", r"TypeError.*colour"),
    "include": ("{% include 'secrets.j2' %}", r"\{% include %\}.*self-contained"),
    "import": ("{% import 'macros.j2' as m %}{{ m.x() }}", r"\{% import %\}"),
    "from import": ("{% from 'macros.j2' import x %}{{ x() }}", r"\{% import %\}"),
    "extends": ("{% extends 'base.j2' %}", r"\{% extends %\}"),
    "dynamic include": ("{% include messages[0]['content'] %}", r"\{% include %\}"),
    "undefined variable": ("{{ tools_in_user_message.x }}", r"undefined value"),
    "undefined call": ("{{ lipsum(1000000000) }}", r"undefined value.*lipsum"),
    "sandbox escape": ("{{ messages.__class__.__mro__[1].__subclasses__() }}", r"sandbox forbids"),
    "mutation": ("{{ messages.append(1) }}", r"sandbox forbids"),
    "raise_exception": ("{{ raise_exception('no tools here') }}", r"refused the conversation: no tools here"),
    "empty output": ("{% for m in messages %}{% endfor %}", r"empty text"),
    "whitespace output": ("{% for m in messages %}  \n\t{% endfor %}", r"empty text"),
    "syntax error": ("{% for m in messages %}{{ m }", r"not valid Jinja2 \(line 1"),
    "unknown filter": ("{{ messages|explode }}", r"not valid Jinja2.*explode"),
    "deep nesting": ("{% if 1 %}" * 3000 + "x" + "{% endif %}" * 3000, r"recurses too deeply|not valid"),
    "huge template": ("x" * (template_sandbox.MAX_TEMPLATE_CHARS + 1), r"characters long"),
}


@pytest.fixture
def quick_deadline(monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_SECONDS", 0.5)


@pytest.mark.parametrize("template, problem", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_template_is_one_line_naming_the_file(template, problem, quick_deadline):
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    start = time.monotonic()
    error = api_refused(lambda: render_chat(MESSAGES, template, source=SOURCE), ChatTemplateError,
                        names=[r"^/models/evil\.gguf \(tokenizer\.chat_template\): the chat template ",
                               problem, r"Fix the template in /models/evil\.gguf"])
    assert time.monotonic() - start < 15.0, f"took {time.monotonic() - start:.1f} s: {error}"  # a hang is minutes
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    assert grown_mb < 1024, f"peak memory grew by {grown_mb:.0f} MB: {error}"


def test_the_deadline_is_wall_clock_seconds(monkeypatch):
    monkeypatch.setattr(template_sandbox, "MAX_SECONDS", 1.0)
    start = time.monotonic()
    api_refused(lambda: render_chat(MESSAGES, HOSTILE["nested loops 1e10"][0]), ChatTemplateError,
                names=[r"ran for more than 1 s"])
    assert 1.0 <= time.monotonic() - start < 5.0


def test_limits_leave_real_work_alone():
    """Big but legitimate conversations render exactly (the limits are far above real use)."""
    long_text = "word " * 400_000  # 2 MB in one message
    messages = [{"role": "user", "content": long_text}, {"role": "assistant", "content": "ok"}] * 3
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    assert render_chat(messages, CHATML_TEMPLATE, add_generation_prompt=False) == expected
    edits = "{{ messages[0]['content']|replace('word', 'w') }}{{ messages[0]['content'].replace('o', 'oo')|length }}"
    assert render_chat(messages, edits) == "w " * 400_000 + str(len(long_text) + 400_000)
    loops = "{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}{{ 'x' * 5 ~ 7 * 6 }}"
    assert render_chat(MESSAGES, loops) == "xxxxx42"
    macros = ("{% macro f(n) %}{% if n > 0 %}{{ n }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(30) }}"
              "{{ '%5d|%-3s|' % (42, 'a') }}{{ '{:>4}'.format('b') }}{{ 'c'|center(5) }}{{ [1, 2]|tojson(indent=2) }}")
    assert render_chat(MESSAGES, macros) == ("".join(str(n) for n in range(30, 0, -1)) + "   42|a  |"
                                             + "   b" + "  c  " + "[\n  1,\n  2\n]")


# ------------------------------------------------------------------ tokenizer_config.json

def _tokenizer_dir(tmp_path: Path, config: bytes | None) -> Path:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_bytes(config)
    return tmp_path


BAD_CONFIGS = {
    "a list": (b'[{"chat_template": "x"}]', r"expected a JSON object.*found a list"),
    "not UTF-8": (b'{"chat_template": "\xff\xfe"}', r"not UTF-8"),
    "truncated": (b'{"chat_template": "{{ messa', r"not valid JSON.*truncated"),
    "template a number": (b'{"chat_template": 5}', r"'chat_template' is 5; expected a string"),
    "template an object": (b'{"chat_template": {"a": 1}}', r"'chat_template' is \{'a': 1\}; expected a string"),
    "named templates without default": (b'{"chat_template": [{"name": "tool_use", "template": "x"}]}',
                                        r"none is named 'default'"),
    "named template not a string": (b'{"chat_template": [{"name": "default", "template": 3}]}',
                                    r"chat_template\[0\]\.template' is 3"),
    "add_bos_token not a boolean": (b'{"add_bos_token": "yes"}', r"'add_bos_token' is 'yes'; expected true or false"),
    "a directory": (None, r"expected a tokenizer config, found a directory"),
}


@pytest.mark.parametrize("content, problem", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_broken_tokenizer_config_names_the_file(tmp_path, content, problem):
    from lucidlm.tokenizers.pretrained import HFTokenizer

    directory = _tokenizer_dir(tmp_path, content)
    if content is None:
        (directory / "tokenizer_config.json").mkdir()
    api_refused(lambda: HFTokenizer.from_file(directory / "tokenizer.json"), TokenizerError,
                names=[r"tokenizer_config\.json", problem], watch=[directory])


def test_named_templates_use_the_default_one_and_errors_name_the_config(tmp_path):
    from lucidlm.chat import render_chat_for
    from lucidlm.tokenizers.pretrained import HFTokenizer

    config = {"chat_template": [{"name": "tool_use", "template": "T"},
                                {"name": "default", "template": "{{ messages[0]['content'] }}!{{ 1 / 0 }}"}]}
    directory = _tokenizer_dir(tmp_path, json.dumps(config).encode())
    tokenizer = HFTokenizer.from_file(directory / "tokenizer.json")
    assert tokenizer.chat_template == config["chat_template"][1]["template"]
    api_refused(lambda: render_chat_for(tokenizer, MESSAGES), ChatTemplateError,
                names=[rf"^{directory / 'tokenizer_config.json'} \(chat_template\): .*divides by zero"])


# ------------------------------------------------------------------ the CLI, end to end

def _gguf_with_template(path: Path, template: str) -> Path:
    weights = {k: to_gguf_layout(k, v) for k, v in tiny_weights(1).items()}
    return write_llama_gguf(path, weights, 1, chat_template=template)


@pytest.mark.parametrize("command, template, problem", [
    ("generate", HOSTILE["nested loops 1e10"][0], r"ran for more than 5 s"),
    ("chat", HOSTILE["string times 1e9"][0], r"repeated string"),
])
def test_cli_refuses_a_hostile_gguf_template(tmp_path, command, template, problem):
    model = _gguf_with_template(tmp_path / "evil.gguf", template)
    args = ["generate", "--model", str(model), "--chat", "hi", "--max-new-tokens", "2"] if command == "generate" \
        else ["chat", "--model", str(model)]
    refused(*args, stdin=b"hello\n/exit\n", names=[r"evil\.gguf \(tokenizer\.chat_template\)", problem],
            watch=[tmp_path])


def test_cli_refuses_a_hugging_face_dir_with_a_list_tokenizer_config(tmp_path):
    from lucidlm.weights.gguf import load_gguf
    from lucidlm.weights.hf import save_hf

    directory = save_hf(load_gguf(_gguf_with_template(tmp_path / "ok.gguf", CHATML_TEMPLATE)), tmp_path / "hf")
    (Path(directory) / "tokenizer_config.json").write_text('["not", "an", "object"]')
    refused("generate", "--model", str(directory), "--chat", "hi", "--max-new-tokens", "2",
            names=[r"tokenizer_config\.json", r"found a list"], watch=[tmp_path])
