"""Every public entry point says what it takes and returns: no parameter or return annotated
``Any`` (or not at all), so help() and Jupyter's shift-tab show real types. A ``**options``
that passes names on to another function may stay ``Any``: those are listed below, each
with the reason."""

from __future__ import annotations

import importlib
import inspect
import re

import lucidlm
from lucidlm.inspect import ActivationCache, LogitLens
from lucidlm.language_model import LanguageModel

PACKAGES = ["lucidlm", "lucidlm.generation", "lucidlm.inspect", "lucidlm.peft", "lucidlm.training",
            "lucidlm.quantization", "lucidlm.model", "lucidlm.tokenizers", "lucidlm.chat", "lucidlm.evaluation",
            "lucidlm.inspect.patching", "lucidlm.inspect.loss_plot"]

# (entry point, parameter): why Any is the truth there.
ALLOWED_ANY = {
    ("lucidlm.load", "config_overrides"): "ModelConfig fields, each of its own type",
    ("lucidlm.preset", "overrides"): "ModelConfig fields, each of its own type",
    ("ModelConfig.replace", "changes"): "ModelConfig fields, each of its own type",
    ("lucidlm.generation.generate", "unknown"): "refused by name (or a new sampler's field)",
    ("lucidlm.generation.stream", "unknown"): "refused by name (or a new sampler's field)",
    ("lucidlm.generation.check_options", "kwargs"): "generate's options, each of its own type",
    ("Conversation.reply", "gen_kwargs"): "stream's options, each of its own type",
    ("lucidlm.chat.render_chat", "extra"): "template variables, of whatever type the template reads",
    ("LanguageModel.generate", "options"): "input_ids= (transformers' name); others are refused",
    ("LanguageModel.stream", "options"): "refused by name (or a new sampler's field)",
    ("lucidlm.inspect.run_with_cache", "forward_kwargs"): "Transformer.forward's arguments",
    ("lucidlm.inspect.run_with_hooks", "forward_kwargs"): "Transformer.forward's arguments",
    ("LanguageModel.run_with_cache", "forward_kwargs"): "Transformer.forward's arguments",
    ("LanguageModel.run_with_hooks", "forward_kwargs"): "Transformer.forward's arguments",
    ("LanguageModel.forward", "args"): "Transformer.forward's arguments",
    ("LanguageModel.forward", "kwargs"): "Transformer.forward's arguments",
    ("LanguageModel.to", "args"): "nn.Module.to's (device, dtype, tensor, non_blocking)",
    ("LanguageModel.to", "kwargs"): "nn.Module.to's (device, dtype, tensor, non_blocking)",
    **{(f"HookPoint.{name}", arg): "torch's own registration, passed through"
       for name in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                    "register_full_backward_pre_hook") for arg in ("args", "kwargs")},
}


def _entry_points() -> dict[str, object]:
    """Each package's __all__, and the public methods (and properties) of its classes,
    LanguageModel's, ActivationCache's and LogitLens's among them."""
    found: dict[str, object] = {}
    classes = {"LanguageModel": LanguageModel, "ActivationCache": ActivationCache, "LogitLens": LogitLens}
    for package in PACKAGES:
        module = importlib.import_module(package)
        public = getattr(module, "__all__", None) or [  # patching has no __all__: what it defines
            name for name, value in vars(module).items() if getattr(value, "__module__", None) == package]
        for name in public:
            if name.startswith("_"):
                continue
            value = getattr(module, name)
            if inspect.isclass(value):
                classes.setdefault(value.__name__, value)
            elif inspect.isroutine(value):
                found.setdefault(f"{package}.{name}", value)
    for class_name, cls in classes.items():
        for name, member in vars(cls).items():
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member):
                found[f"{class_name}.{name}"] = member
    return found


def _is_any(annotation: str) -> bool:
    """``Any`` itself or as one member of a top-level Optional / Union / ``|`` (``dict[str, Any]``,
    a record of mixed values, says what it is)."""
    text = annotation.strip().strip("'\"")
    inner = re.fullmatch(r"(?:typing\.)?(?:Optional|Union)\[(.*)\]", text)
    members = _top_level_split(inner.group(1) if inner else text)
    return any(m.strip() in ("Any", "typing.Any") for m in members)


def _top_level_split(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "["
        depth -= char == "]"
        if depth == 0 and char in ",|":
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _shown(annotation: object) -> str:
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def test_no_public_entry_point_takes_or_returns_any():
    problems = []
    for label, fn in _entry_points().items():
        signature = inspect.signature(fn)
        for name, param in signature.parameters.items():
            if name in ("self", "cls"):
                continue
            if param.annotation is inspect.Parameter.empty:
                problems.append(f"{label}({name}): not annotated")
            elif _is_any(_shown(param.annotation)) and (label, name) not in ALLOWED_ANY:
                problems.append(f"{label}({name}): {_shown(param.annotation)}")
        returned = signature.return_annotation
        if returned is inspect.Signature.empty and not label.endswith("__init__"):
            problems.append(f"{label}: return not annotated")
        elif returned is not inspect.Signature.empty and _is_any(_shown(returned)):
            problems.append(f"{label}: returns {_shown(returned)}")
    assert not problems, "\n".join(problems)


def test_the_allow_list_names_only_parameters_that_exist():
    points = _entry_points()
    for label, name in ALLOWED_ANY:
        assert name in inspect.signature(points[label]).parameters, (label, name)


def test_the_any_check_reads_annotations_as_written():
    assert _is_any("Any") and _is_any("Optional[Any]") and _is_any("Union[int, Any]") and _is_any("int | Any")
    assert not _is_any("dict[str, Any]") and not _is_any("Callable[..., Any]") and not _is_any("Many")


def test_the_named_options_are_the_ones_the_functions_take():
    # model.run_with_cache / run_with_hooks and generation.stream name their options: the same
    # names, defaults included, as the functions they pass them to.
    from lucidlm import generation
    from lucidlm import inspect as li

    def options(fn, skip=()):
        return {n: p.default for n, p in inspect.signature(fn).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY or (p.default is not inspect.Parameter.empty)
                if n not in skip}

    assert options(LanguageModel.run_with_cache) == options(li.run_with_cache)
    assert options(LanguageModel.run_with_hooks) == options(li.run_with_hooks)
    assert options(generation.stream, skip=("steady",)) == options(generation.generate)
    assert lucidlm.__all__  # the package's own names are part of the enumeration above
