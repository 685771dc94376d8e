"""Command-line flags generated from a recipe's config dataclass.

Every field becomes ``--field-name`` with the field's type and help (from its ``metadata``);
a flag left out takes the field's own default when the config is built, so ``lucidlm train`` /
``lucidlm finetune`` and the Python recipes cannot disagree on a default, and the flags the
user typed are known (``typed_fields``). Booleans become switches: ``--name`` for a False
default, ``--no-name`` for a True one (or the ``flag`` the metadata names, which sets the
opposite).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Iterable, Union

from lucidlm.commands import arg_types
from lucidlm.training.config import flag_of


def _base_type(annotation: Any) -> type:
    if typing.get_origin(annotation) is Union:  # Optional[X]
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation


def add_config_flags(parser: argparse.ArgumentParser | Any, config_class: type, skip: Iterable[str] = (),
                     required: Iterable[str] = ()) -> None:
    hints = typing.get_type_hints(config_class)
    defaults = config_class.__dataclass_fields__
    skip, required = set(skip), set(required)
    for f in dataclasses.fields(config_class):
        if f.name in skip:
            continue
        meta = f.metadata
        kind = _base_type(hints[f.name])
        help_text = meta.get("help", "")
        if kind is bool:
            parser.add_argument(*meta.get("short", "").split(), flag_of(config_class, f.name), dest=f.name,
                                action="store_false" if f.default else "store_true", default=argparse.SUPPRESS,
                                help=help_text)
            continue
        flag = flag_of(config_class, f.name)
        default = defaults[f.name].default
        if meta.get("text"):
            kind = arg_types.text
        # a required flag has no default on the command line (the field's is Python's alone)
        suffix = ("" if "(default" in help_text or default in (None, "") or f.name in required
                  else f" (default: {default})")
        parser.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS,  # left out: not in args
                            choices=meta.get("choices"), required=f.name in required,
                            metavar=None if meta.get("choices") else _metavar(hints[f.name]), help=help_text + suffix)


def _metavar(annotation: Any) -> str:
    return _base_type(annotation).__name__.upper()


def typed_fields(config_class: type, args: argparse.Namespace) -> list[str]:
    """The fields whose flags are on the command line (a flag left out is not in ``args``)."""
    return [f.name for f in dataclasses.fields(config_class) if hasattr(args, f.name)]


def config_from_args(config_class: type, args: argparse.Namespace, **fixed: Any) -> Any:
    """The config of the typed flags, the field defaults for the others."""
    values = {name: getattr(args, name) for name in typed_fields(config_class, args)}
    return config_class(**{**values, **fixed})
