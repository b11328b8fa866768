"""Config fields as options: every entry point's flags and keyword arguments come from here.

A config dataclass declares each option once, with its default and its one-line help::

    @dataclass(frozen=True)
    class SchedulerConfig:
        max_num_seqs: int = option(64, "most sequences running at once")

and every entry point derives what it offers from those fields:

    add_options(parser, SchedulerConfig)        argparse: --max-num-seqs (type, default, help, choices)
    from_namespace(SchedulerConfig, args)       the config back from parsed arguments
    split_options({...}, LoadConfig, ...)       keyword arguments (``LLM(max_num_seqs=8)``) sorted into
                                                configs; an unknown key is an error that names it
    options_doc(SchedulerConfig, ...)           the "Options" section of a docstring

So a default, a help text or a flag name is written once, in its dataclass, and ``LLM(...)``,
``tokenmill serve``, ``tokenmill bench offline``, ``tokenmill eval`` and ``tokenmill quantize``
agree on it by construction (tests/test_options.py compares them field by field).

Flag names are the field names with ``-`` for ``_``; a bool field gets ``--name`` and ``--no-name``.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import Field, field
from typing import Any, Iterable, Literal

from tokenmill.errors import InvalidParameterError


def option(default: Any, help: str, *, choices: Iterable[Any] | None = None, short: str | None = None,
           metavar: str | None = None, cli: bool = True) -> Any:
    """A config field with its one-line help. ``cli=False`` keeps it out of command lines
    (Python-only options such as objects); ``short`` adds an alias flag such as ``-m``."""
    metadata = {"help": help, "choices": tuple(choices) if choices is not None else None, "short": short,
                "metavar": metavar, "cli": cli}
    return field(default=default, metadata=metadata)


def option_fields(cls: type, only: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[Field]:
    """The fields of ``cls`` declared with :func:`option`, in declaration order."""
    wanted = set(only) if only is not None else None
    fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata and f.name not in set(exclude)]
    if wanted is not None:
        unknown = wanted - {f.name for f in fields}
        if unknown:
            raise ValueError(f"{cls.__name__} has no option(s) {sorted(unknown)}")
        fields = [f for f in fields if f.name in wanted]
    return fields


def add_option_group(parser: argparse.ArgumentParser, cls: type, **kwargs: Any) -> None:
    """:func:`add_options` under a heading: the class's ``title`` (a ClassVar), else its name."""
    add_options(parser.add_argument_group(f"{getattr(cls, 'title', cls.__name__)} options"), cls, **kwargs)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type,
                only: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> None:
    """Add one flag per command-line option field of ``cls`` (see the module docstring)."""
    hints = typing.get_type_hints(cls)
    for f in option_fields(cls, only, exclude):
        if not f.metadata["cli"]:
            continue
        names = [flag_name(f.name)] + ([f.metadata["short"]] if f.metadata["short"] else [])
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": _help_with_default(f)}
        kind = hints[f.name]
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _parser_of(kind)
            choices = f.metadata["choices"] or _literal_choices(kind)
            if choices:
                kwargs["choices"] = choices
            if f.metadata["metavar"]:
                kwargs["metavar"] = f.metadata["metavar"]
        parser.add_argument(*names, **kwargs)


def _help_with_default(f: Field) -> str:
    return f.metadata["help"] if f.default is None else f"{f.metadata['help']} (default: {f.default})"


def _literal_choices(kind: Any) -> tuple | None:
    return typing.get_args(kind) if typing.get_origin(kind) is Literal else None


def _parser_of(kind: Any):
    """str -> value for a field type: int, float, str, a Literal, ``X | None``, ``float | int``."""
    if typing.get_origin(kind) is Literal:
        return type(typing.get_args(kind)[0])
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if args:  # a union: the widest number type it admits, else its first type
        if float in args:
            return number
        return _parser_of(args[0])
    if kind in (int, float, str):
        return kind
    return str


def number(text: str) -> float | int:
    """A number flag that may be a fraction or a count (``0.2``, ``2147483648``, ``2e9``)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    return int(value) if value.is_integer() and value >= 1 else value


def from_namespace(cls: type, args: argparse.Namespace, **overrides: Any):
    """The config ``cls`` from parsed arguments (its command-line fields), plus ``overrides``."""
    values = {f.name: getattr(args, f.name) for f in option_fields(cls) if f.metadata["cli"] and hasattr(args, f.name)}
    return cls(**{**values, **overrides})


def split_options(options: dict[str, Any], *classes: type) -> list[dict[str, Any]]:
    """Sort keyword options into one dict per config class; an unknown key is an error naming it."""
    out: list[dict[str, Any]] = [{} for _ in classes]
    owner = {f.name: i for i, cls in enumerate(classes) for f in option_fields(cls)}
    unknown = sorted(set(options) - owner.keys())
    if unknown:
        raise InvalidParameterError(
            f"unknown option(s) {', '.join(map(repr, unknown))}; known options are {', '.join(sorted(owner))}")
    for name, value in options.items():
        out[owner[name]][name] = value
    return out


def options_doc(*classes: type) -> str:
    """A docstring section listing every option of ``classes``: name, default and help."""
    lines = ["Options (keyword arguments; the same names as the command-line flags):", ""]
    for cls in classes:
        for f in option_fields(cls):
            lines.append(f"    {f.name} = {f.default!r}: {f.metadata['help']}")
    return "\n".join(lines)
