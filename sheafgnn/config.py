"""Dataclass configs that load from and save to YAML, TOML or JSON, take ``KEY=VALUE``
overrides, and print themselves; and the command line's one-line-error argument parser."""

from __future__ import annotations

import argparse
import copy
import difflib
import functools
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import fields
from pathlib import Path

import yaml


class _YAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that reads ``1e-3`` as a number, as YAML 1.2 does (PyYAML's YAML 1.1
    wants ``1.0e-3`` and reads ``1e-3`` as a string)."""


_YAMLLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                  re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                  list("-+0123456789"))


def _read_yaml(text: str):
    """Parse YAML text with :class:`_YAMLLoader`."""
    return yaml.load(text, Loader=_YAMLLoader)


class ConfigFile:
    """Mixin for ``@dataclass`` configs: ``to_dict``/``from_dict``/``load``/``save``/``with_overrides``/``str``."""

    def to_dict(self) -> dict:
        """The fields as plain values; a nested config as its own ``to_dict()``."""
        return {f.name: value.to_dict() if isinstance(value, ConfigFile) else copy.deepcopy(value)
                for f in fields(self) for value in [getattr(self, f.name)]}

    @classmethod
    def from_dict(cls, values: dict):
        """The config of ``values``; unknown fields and values of the wrong type are ``ValueError``s."""
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}{_did_you_mean(unknown[0], cls)}")
        check_field_types(cls, values)
        return cls(**values)

    def with_overrides(self, assignments: Iterable[str]):
        """A copy with ``KEY=VALUE`` assignments applied, in order (the command line's ``--set``).

        ``VALUE`` is read as YAML (``8``, ``0.5``, ``true``, ``null``, ``[local, sentence]``,
        ``{d_model: 64}``; quote a string that YAML would read otherwise). A dotted
        ``KEY`` reaches into a mapping field: ``model_config.d_model=64``, ``site.local_window=8``.
        """
        values = self.to_dict()
        for assignment in assignments:
            _assign(values, assignment, type(self))
        return type(self).from_dict(values)

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a ``.yaml``/``.yml``, ``.toml`` or ``.json`` file of fields."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{cls.__name__}.load: no config file at {path}")
        parsers = {".yaml": _read_yaml, ".yml": _read_yaml, ".toml": tomllib.loads, ".json": json.loads}
        parse = parsers.get(path.suffix)
        if parse is None:
            raise ValueError(f"{cls.__name__}.load: unknown config format {path.suffix!r} (use yaml, toml or json)")
        try:
            values = parse(path.read_text())
        except yaml.YAMLError as err:
            raise ValueError(f"{cls.__name__}.load: {path} is not valid yaml: {_yaml_problem(err)}") from None
        except ValueError as err:  # TOML, JSON and UTF-8 decoding errors are ValueErrors
            raise ValueError(f"{cls.__name__}.load: {path} is not valid {path.suffix[1:]}: {err}") from None
        if not isinstance(values, (dict, type(None))):
            raise ValueError(f"{cls.__name__}.load: {path} must hold a mapping of fields")
        return cls.from_dict(values or {})

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One flag per field (``--field-name``) with default None, so that the flags given can be told apart."""
        defaults, hints = cls(), typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name in skip:
                continue
            value, flag = getattr(defaults, f.name), "--" + f.name.replace("_", "-")
            if isinstance(value, tuple):
                kind = (typing.get_args(hints[f.name]) or (str,))[0]  # tuple[float, ...] -> float, even when empty
                parser.add_argument(flag, nargs="+", type=kind, help=f"(default: {' '.join(map(str, value))})")
            elif isinstance(value, dict):
                parser.add_argument(flag, type=json.loads, help=f"JSON object of fields (default: {json.dumps(value)})")
            elif isinstance(value, bool):
                parser.add_argument(flag, type=_parse_bool, help=f"true or false (default: {value})")
            else:
                parser.add_argument(flag, type=type(value) if value is not None else str, help=f"(default: {value})")

    @classmethod
    def given_values(cls, args: argparse.Namespace) -> dict:
        """The fields that :meth:`add_arguments` flags set on the command line."""
        names = {f.name for f in fields(cls)}
        return {k: v for k, v in vars(args).items() if v is not None and k in names}

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))

    def __str__(self) -> str:
        rows = [f"  {f.name:<20}{getattr(self, f.name)!r}" for f in fields(self)]
        return f"{type(self).__name__}(\n" + "\n".join(rows) + "\n)"


def _assign(values: dict, assignment: str, cls: type) -> None:
    """Apply ``KEY=VALUE`` to ``values``, the field dict of a ``cls`` config."""
    key, equals, text = assignment.partition("=")
    if not equals or not key:
        raise ValueError(f"--set {assignment!r}: expected KEY=VALUE, e.g. steps=2 or model_config.d_model=64")
    try:
        value = _read_yaml(text)
    except yaml.YAMLError as err:
        raise ValueError(f"--set {assignment!r}: the value is not valid YAML ({_yaml_problem(err)})") from None
    *parents, last = key.split(".")
    field_name = (parents or [last])[0]
    if field_name not in values:
        raise ValueError(f"--set {key}: {cls.__name__} has no field {field_name!r}{_did_you_mean(field_name, cls)}")
    target = values
    for depth, name in enumerate(parents):
        target = target.get(name)
        if not isinstance(target, dict):
            raise ValueError(f"--set {key}: {'.'.join(parents[: depth + 1])} is {target!r}, not a mapping")
    target[last] = value


def _did_you_mean(name: str, cls: type) -> str:
    close = difflib.get_close_matches(name, [f.name for f in fields(cls)], n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; the fields are {[f.name for f in fields(cls)]}"


def check_field_types(cls: type, values: dict) -> None:
    """Raise a ``ValueError`` naming the first field of ``values`` whose value does not fit its
    annotation in the dataclass ``cls`` (``d_model: "abc"`` where an ``int`` is expected)."""
    for name, value in values.items():
        hint = _field_types(cls).get(name)
        if hint is not None and not _fits(value, hint):
            raise ValueError(f"{cls.__name__}: {name} must be {_describe(hint)} (got {value!r})")


@functools.cache
def _field_types(cls: type) -> dict[str, typing.Any]:
    """The resolved type annotation of each field of the dataclass ``cls``."""
    return typing.get_type_hints(cls)


def _fits(value, hint) -> bool:
    """Whether ``value`` (from YAML, TOML, JSON or Python) fits the annotation ``hint``.

    Containers are checked by kind only (a ``tuple[str, ...]`` field takes any list or tuple).
    An annotation this does not know (a class, ``Any``) accepts everything."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_fits(value, member) for member in typing.get_args(hint))
    kind = typing.get_origin(hint) or hint
    if kind is type(None):
        return value is None
    if kind in (tuple, list):
        return isinstance(value, (tuple, list))
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in (bool, str, dict):
        return isinstance(value, kind)
    return True


def _describe(hint) -> str:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return " or ".join(_describe(member) for member in typing.get_args(hint))
    kind = typing.get_origin(hint) or hint
    names = {type(None): "null", tuple: "a list", list: "a list", dict: "a mapping", float: "a number",
             int: "an integer", bool: "true or false", str: "a string"}
    return names.get(kind, getattr(kind, "__name__", str(kind)))


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error on one line: the problem and where."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


# ---------------------------------------------------------------------------
# Command-line arguments
# ---------------------------------------------------------------------------


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` whose errors are one line on stderr,
    ``PROG: error: MESSAGE``, with exit status 2 (no usage block)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer that is at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {value}")
        return value

    return parse


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
