"""A pretrained tokenizer read from Hugging Face files: ``tokenizer.json`` (the backend, spelled
out in full) and ``tokenizer_config.json`` beside it (the bos/eos/pad/unk roles, whether BOS
is added). The chat template is where transformers keeps it: ``chat_template.jinja`` and
``additional_chat_templates/*.jinja`` (written by ``save_pretrained`` since transformers 4.43),
else the config's ``chat_template`` (a string, or a list of named templates).

``HFTokenizer.from_file`` (``pretrained.py``) calls ``tokenizer_from_file``, handing it the
class to build (this module does not import ``pretrained.py``, which imports it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from lucidlm.errors import TokenizerError
from lucidlm.tokenizers.regex_safety import check_backend_regexes
from lucidlm.validation import Fields


def is_parse_failure(exc: BaseException) -> bool:
    """Whether ``exc``, raised by the tokenizers backend while it parses a tokenizer.json, means
    the file is bad: an ordinary exception, or a panic of its Rust code (a damaged normalizer
    charsmap panics), which pyo3 raises as PanicException, a BaseException. Ctrl-C is neither."""
    return isinstance(exc, Exception) or type(exc).__name__ == "PanicException"


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def tokenizer_from_file(cls: Any, path: str | Path, config_path: Optional[str | Path] = None) -> Any:
    """An ``HFTokenizer`` (``cls``) reading a Hugging Face ``tokenizer.json``. Roles (bos/eos/pad)
    and add_bos come from ``tokenizer_config.json`` beside it (or ``config_path``) if present,
    the chat template from the template files in the config's folder or else from the config
    (``_chat_template``); ``HFTokenizer.from_file`` calls this."""
    from tokenizers import Tokenizer as Backend

    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {path} does not exist.")
    try:
        backend = Backend.from_file(str(path))
    except BaseException as exc:  # noqa: BLE001 - a panic of the backend is a BaseException
        if not is_parse_failure(exc):
            raise
        raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json ({_one_line(exc)}).") from None
    check_backend_regexes(backend, str(path))
    config_path = Path(config_path) if config_path else path.with_name("tokenizer_config.json")
    config = _read_tokenizer_config(config_path) if config_path.exists() else {}

    def role(name: str) -> Optional[str]:
        value = config.get(name)
        if isinstance(value, dict):  # {"content": "<s>", ...}, transformers' AddedToken form
            value = value.get("content")
        return value if isinstance(value, str) and backend.token_to_id(value) is not None else None

    bos = role("bos_token")
    add_bos = Fields(config, config_path, TokenizerError).bool("add_bos_token", default=None)
    if add_bos is None:  # no config: does the file's post-processor put a token first?
        first = post_processor_bos(backend)
        add_bos = first is not None
        if add_bos and bos is None:
            bos = first
    # The post-processor stays in the backend (save_hf writes it back), but lucidlm never runs
    # it: encode() calls the backend with add_special_tokens=False and puts BOS first itself.
    # An EOS the post-processor would append ("<s> $A </s>") is not added: a prompt goes on.
    template, template_source = _chat_template(config, config_path)
    tokenizer = cls(backend, add_bos=bool(add_bos), bos_token=bos, eos_token=role("eos_token"),
                    pad_token=role("pad_token"), unk_token=role("unk_token"),
                    chat_template=template, source=str(path))
    tokenizer.chat_template_source = template_source
    return tokenizer


def post_processor_bos(backend: Any) -> Optional[str]:
    """The token the backend's post-processor puts before the text, or None. A template may
    also append tokens ("<s> $A </s>"): only what comes first counts."""
    with_special = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    if len(with_special) > len(without) and with_special[1:1 + len(without)] == without:
        return backend.id_to_token(with_special[0])
    return None


def with_bos_post_processor(backend: Any, bos: Optional[str]) -> str:
    """The backend's tokenizer.json text, its post-processor kept where it puts ``bos`` first
    (None: nothing) as lucidlm's encode does, else replaced by one that does exactly that."""
    from tokenizers import processors

    if post_processor_bos(backend) == bos:
        return backend.to_str()
    copy = type(backend).from_str(backend.to_str())
    if bos is None:
        copy.post_processor = None
    else:
        pair = [bos, "$A", bos, "$B:1"]
        copy.post_processor = processors.TemplateProcessing(
            single=[bos, "$A"], pair=pair, special_tokens=[(bos, backend.token_to_id(bos))])
    return copy.to_str()


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` as a JSON object, or one line naming the file and the problem."""
    from lucidlm.validation import read_json_object

    return dict(read_json_object(path, TokenizerError, "tokenizer config",
                                 fix="fix or replace it with the model's original tokenizer_config.json").data)


# The files transformers' save_pretrained writes templates to (transformers/utils/hub.py).
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


def _chat_template(config: dict[str, Any], config_path: Path) -> tuple[Optional[str], str]:
    """The chat template a chat uses, and where it came from (for error messages).

    As in transformers' ``from_pretrained``: template files in the config's folder, if there
    are any, replace the config's ``chat_template`` entirely; ``chat_template.jinja`` is the
    template named "default" and ``additional_chat_templates/NAME.jinja`` the one named NAME.
    Of several named templates the "default" one is used, as ``apply_chat_template`` does
    without ``tools`` or a template name (lucidlm passes neither)."""
    folder = config_path.parent
    files = {}
    if (folder / CHAT_TEMPLATE_FILE).is_file():
        files["default"] = folder / CHAT_TEMPLATE_FILE
    if (folder / CHAT_TEMPLATE_DIR).is_dir():
        files.update((file.name.removesuffix(".jinja"), file)
                     for file in sorted((folder / CHAT_TEMPLATE_DIR).glob("*.jinja")) if file.is_file())
    if files:
        if "default" not in files:
            raise TokenizerError(f"{folder / CHAT_TEMPLATE_DIR} holds chat templates {sorted(files)} but there is no "
                                 f"{folder / CHAT_TEMPLATE_FILE}, the template a chat uses. Copy the model's "
                                 f"{CHAT_TEMPLATE_FILE} there, or rename one of them to {CHAT_TEMPLATE_FILE}.")
        return _read_template(files["default"]), str(files["default"])
    return _config_chat_template(config, config_path), f"{config_path} (chat_template)"


def _read_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(f"{path} is not UTF-8 text (byte {exc.start}); replace it with the model's original "
                             f"{path.name}.") from None
    except OSError as exc:
        raise TokenizerError(f"cannot read the chat template {path}: {exc.strerror or exc}.") from None


def _config_chat_template(config: dict[str, Any], path: Path) -> Optional[str]:
    """The config's chat template: a string, or transformers' list of named templates (the
    "default" one is used, as ``apply_chat_template`` does)."""
    fields = Fields(config, path, TokenizerError, fix="fix or replace the tokenizer config")
    value = fields.raw("chat_template", None)
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        fields.str("chat_template")  # refuses it: "expected a string"
    named = fields.list("chat_template", item=dict)
    templates = {}
    for i, entry in enumerate(named):
        entry_fields = Fields(entry, path, TokenizerError, where=f"chat_template[{i}]", fix=fields.fix)
        templates[entry_fields.str("name")] = entry_fields.str("template")
    if "default" not in templates:
        raise TokenizerError(f"{path}: chat_template lists templates {sorted(templates)} but none is named "
                             f"'default', the one a chat uses. Name one of them 'default'.")
    return templates["default"]


__all__ = ["post_processor_bos", "tokenizer_from_file", "with_bos_post_processor"]
