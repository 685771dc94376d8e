"""Chat templates, streamed text and the chat REPL at their edges, against transformers:
templates saved to ``chat_template.jinja`` (transformers >= 4.43), message keys set to None,
a stop string that only the final U+FFFD flush could match, a non-UTF-8 byte in a typed
message, and how many encodings fitting a long conversation to the context costs."""

from __future__ import annotations

import io
import json
import math
from types import SimpleNamespace

import pytest
import torch
from generation_toys import ScriptedModel, byte_tokenizer, one_torch_thread  # noqa: F401 (autouse fixture)
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer
from transformers import AutoTokenizer, PreTrainedTokenizerFast
from transformers.generation.stopping_criteria import StopStringCriteria

import lucidlm.chat
from lucidlm.chat import Conversation, encode_chat, render_chat, render_chat_for
from lucidlm.errors import ChatTemplateError, GenerationError, LucidLMError, TokenizerError
from lucidlm.generation import generate
from lucidlm.generation.streaming import TextAssembler
from lucidlm.tokenizers import HFTokenizer

SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
TOOL_USE = "{% for message in messages %}TOOLS {{ message['content'] }}{% endfor %}"
MESSAGES = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi there 🇫🇷"},
            {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


@pytest.fixture(scope="module")
def backend() -> Tokenizer:
    """A small byte-level BPE (any text encodes) with Llama 3's chat markers as special tokens."""
    tokenizer = Tokenizer(BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["system user assistant Be terse. Hi there Hello! Bye the quick brown fox"] * 20
    tokenizer.train_from_iterator(corpus, BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def hf_tokenizer(backend: Tokenizer, template) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(backend.to_str()),
                                 bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    hf.chat_template = template
    return hf


def hf_ids(hf, messages, add_generation_prompt=True) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if not isinstance(out, list) else out)


# ------------------------------------------------------------- chat_template.jinja (finding 1)
def test_template_saved_by_transformers_to_chat_template_jinja_is_used(backend, tmp_path):
    hf = hf_tokenizer(backend, LLAMA3)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()  # transformers 5 keeps it out of the config
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    for add_generation_prompt in (True, False):
        expected_text = reloaded.apply_chat_template(MESSAGES, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
        assert expected_text.startswith("<|begin_of_text|><|start_header_id|>system")  # not ChatML
        assert render_chat_for(ours, MESSAGES, add_generation_prompt) == expected_text
        assert encode_chat(ours, MESSAGES, add_generation_prompt) == hf_ids(reloaded, MESSAGES, add_generation_prompt)
    assert ours.chat_template_source == str(tmp_path / "chat_template.jinja")


def test_chat_template_jinja_wins_over_the_config_key(backend, tmp_path):
    hf_tokenizer(backend, LLAMA3).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}OLD {{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert encode_chat(ours, MESSAGES) == hf_ids(reloaded, MESSAGES)
    assert ours.chat_template == reloaded.chat_template == LLAMA3


def test_named_templates_in_additional_chat_templates_use_the_default(backend, tmp_path):
    hf_tokenizer(backend, {"default": LLAMA3, "tool_use": TOOL_USE}).save_pretrained(tmp_path)
    assert (tmp_path / "additional_chat_templates" / "tool_use.jinja").is_file()
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    assert encode_chat(ours, MESSAGES) == hf_ids(reloaded, MESSAGES)  # no tools: transformers takes "default"


def test_named_templates_without_a_default_are_refused_by_name(backend, tmp_path):
    hf_tokenizer(backend, {"default": LLAMA3, "tool_use": TOOL_USE}).save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no default"):  # transformers cannot chat with it either
        AutoTokenizer.from_pretrained(str(tmp_path)).apply_chat_template(MESSAGES, tokenize=False)
    with pytest.raises(TokenizerError, match=r"\['tool_use'\].*chat_template\.jinja"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json")


def test_errors_of_a_broken_jinja_file_name_that_file(backend, tmp_path):
    hf_tokenizer(backend, "{% for m in messages %}{{ m.content }").save_pretrained(tmp_path)
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    with pytest.raises(ChatTemplateError, match=r"chat_template\.jinja: the chat template is not valid Jinja2"):
        encode_chat(ours, MESSAGES)
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja is not UTF-8"):
        HFTokenizer.from_file(tmp_path / "tokenizer.json")


# ------------------------------------------------------------ None-valued keys (finding 2)
NAMED = ("{% for m in messages %}<|start_header_id|>{{ m.role }}{% if m.name is defined %} ({{ m.name }}){% endif %}"
         "<|end_header_id|>{% if 'tool_calls' in m %}{% for c in m.tool_calls %}[{{ c.function.name }}]{% endfor %}"
         "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}")


def test_message_keys_set_to_none_are_left_out_as_in_transformers(backend, tmp_path):
    hf = hf_tokenizer(backend, NAMED)
    hf.save_pretrained(tmp_path)
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    messages = [{"role": "user", "content": "Hi", "name": None},
                {"role": "assistant", "content": "Hello", "tool_calls": None},
                {"role": "user", "content": "Bye", "name": "ann"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]
    expected = hf.apply_chat_template(messages, tokenize=False)
    assert "(ann)" in expected and "[f]" in expected and "(None)" not in expected
    assert render_chat_for(ours, messages, add_generation_prompt=False) == expected
    assert encode_chat(ours, messages, add_generation_prompt=False) == hf_ids(hf, messages, False)
    assert messages[0]["name"] is None  # the caller's messages are left as they were


# A Qwen/Llama-3.1-style tool template: the tools as JSON, a call's arguments with tojson, the
# content only where the message has one (`if message.content`), tool results grouped with loop.last.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}<|eot_id|>{% endif %}{% for m in messages %}"
    "{% if m.role == 'tool' %}{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "<|start_header_id|>user<|end_header_id|>{% endif %}<tool_response>{{ m.content }}</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|eot_id|>{% endif %}"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls | default([]) %}<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")


def test_a_tool_call_message_with_content_none_renders_as_in_transformers(backend, tmp_path):
    """OpenAI's API returns a message that only calls tools with "content": None; sent back as it
    came, transformers leaves the None out and renders it, so lucidlm must not refuse it."""
    hf = hf_tokenizer(backend, TOOLS_TEMPLATE)
    hf.save_pretrained(tmp_path)
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "22C"}, {"role": "tool", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in <city> é",
                                               "parameters": {"type": "object", "required": ["city"]}}}]
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in expected
        assert "None" not in expected
        assert render_chat_for(ours, messages, add_generation_prompt) == expected
        assert encode_chat(ours, messages, add_generation_prompt) == hf_ids(hf, messages, add_generation_prompt)
        with_tools = hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                            add_generation_prompt=add_generation_prompt)
        assert render_chat(messages, TOOLS_TEMPLATE, add_generation_prompt=add_generation_prompt, tools=tools,
                           bos_token=hf.bos_token, eos_token=hf.eos_token) == with_tools
    assert messages[1]["content"] is None  # the caller's message is left as it was
    with pytest.raises(GenerationError, match="'content': str or None"):  # other types are still refused
        encode_chat(ours, [{"role": "user", "content": ["Hi"]}])


# ------------------------------------------------- stop strings and the final flush (finding 3)
def test_final_flush_replacement_is_not_matched_as_a_stop_string(backend, tmp_path):
    hf_tokenizer(backend, LLAMA3).save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    ids = hf("ok 🇫🇷", add_special_tokens=False)["input_ids"]
    cut = ids[:-1]  # the flag's last byte missing: decoding ends with U+FFFD
    assert hf.decode(cut).endswith("\ufffd")
    # transformers' stop strings match the tokens' own text, which never holds that U+FFFD
    criteria = StopStringCriteria(hf, ["\ufffd"])
    assert not any(bool(criteria(torch.tensor([cut[:k]]), None)[0]) for k in range(1, len(cut) + 1))
    assembler = TextAssembler(ours, stop=["\ufffd"])
    text = "".join(assembler.add(i) for i in cut) + assembler.finish()
    assert text == assembler.text == hf.decode(cut) and not assembler.stopped


def test_generation_cut_mid_character_is_length_with_the_full_decode():
    tokenizer = byte_tokenizer()
    script = list("ok ".encode()) + list("🇫🇷".encode())[:6]  # ends 2 bytes into the second flag letter
    model = ScriptedModel(tokenizer, script, prompt_len=len(tokenizer.encode("Flag:")))
    result = generate(model, "Flag:", max_new_tokens=len(script), stop=["\ufffd"], temperature=0)
    expected = bytes(script).decode("utf-8", errors="replace")  # Python's own decoder: 'ok 🇫\ufffd'
    assert expected.endswith("\ufffd")
    assert (result.text, result.finish_reason, result.token_ids) == (expected, "length", script)


def test_a_replacement_inside_the_output_still_stops():
    tokenizer = byte_tokenizer()
    script = list(b"ab\xffcd")  # 0xff is never UTF-8: the decoder knows at once
    model = ScriptedModel(tokenizer, script, prompt_len=len(tokenizer.encode("x")))
    result = generate(model, "x", max_new_tokens=len(script), stop=["\ufffd"], temperature=0)
    assert (result.text, result.finish_reason, result.token_ids) == ("ab", "stop", script[:3])


# ------------------------------------------------------- a non-UTF-8 typed message (finding 4)
def test_chat_names_a_non_utf8_byte_at_its_place_in_the_typed_message():
    from lucidlm.commands.chat import chat_loop

    typed = "hi\udcff there"  # what stdin (surrogateescape) makes of b"hi\xff there"
    lines = iter([typed, "/system a\udcfeb"])

    def read_line(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    model = ScriptedModel(byte_tokenizer(), [104], prompt_len=0)
    out = io.StringIO()
    assert chat_loop(model, {"max_new_tokens": 2}, read_line=read_line, out=out, interactive=False) == 0
    said = out.getvalue()
    assert f"byte 0xff at character {typed.index(chr(0xdcff))}" in said
    assert "byte 0xfe at character 1" in said and "iconv" in said and "errors='replace'" not in said
    assert model.calls == 0  # refused before anything was rendered or generated


def test_conversation_refuses_a_lone_surrogate_at_its_place_in_the_message():
    convo = Conversation(system="Be terse.")
    with pytest.raises(LucidLMError, match=r"character 5\b"):
        convo.add_user("hello\udce9")
    assert convo.history == []


# ------------------------------------------------ fitting a long chat to the context (note)
def test_fitting_a_long_chat_drops_the_oldest_turns_with_few_encodings(backend, tmp_path, monkeypatch):
    hf_tokenizer(backend, LLAMA3).save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    ours = HFTokenizer.from_file(tmp_path / "tokenizer.json")
    turns = []
    for i in range(40):
        turns += [{"role": "user", "content": f"question {i} " + "Hi there " * (i % 5)},
                  {"role": "assistant", "content": f"answer {i} " + "Hello! " * (i % 3)}]
    turns.append({"role": "user", "content": "last one"})
    system = [{"role": "system", "content": "Be terse."}]
    limit, reserve = 300, 20
    # transformers' token counts, dropping one oldest user+assistant pair at a time
    expected = 0
    while len(hf_ids(hf, system + turns[expected:])) + reserve > limit:
        expected += 2
    assert 0 < expected < len(turns) - 1

    calls = []
    monkeypatch.setattr(lucidlm.chat, "encode_chat", lambda *a, **k: calls.append(1) or encode_chat(*a, **k))
    convo = Conversation(system="Be terse.")
    convo.history = [dict(m) for m in turns]
    model = SimpleNamespace(config=SimpleNamespace(max_seq_len=limit), tokenizer=ours)
    assert convo.fit_context(model, reserve) == expected
    assert convo.history == turns[expected:]
    assert len(calls) <= 2 + math.ceil(math.log2(len(turns) // 2 + 1))  # not one per dropped pair (~20)
