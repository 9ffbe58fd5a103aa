"""Dataclass configs that load from and save to YAML, TOML or JSON, and print themselves."""

from __future__ import annotations

import argparse
import json
import os
import tomllib
from dataclasses import asdict, fields
from pathlib import Path

import yaml


class ConfigFile:
    """Mixin for ``@dataclass`` configs: ``to_dict``/``from_dict``/``load``/``save``/``str``."""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict):
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {unknown}")
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike):
        """Read a ``.yaml``/``.yml``, ``.toml`` or ``.json`` file of fields."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"{cls.__name__}.load: no config file at {path}")
        parsers = {".yaml": yaml.safe_load, ".yml": yaml.safe_load, ".toml": tomllib.loads, ".json": json.loads}
        parse = parsers.get(path.suffix)
        if parse is None:
            raise ValueError(f"{cls.__name__}.load: unknown config format {path.suffix!r} (use yaml, toml or json)")
        try:
            values = parse(path.read_text())
        except (yaml.YAMLError, ValueError) as err:  # TOML and JSON errors are ValueErrors
            raise ValueError(f"{cls.__name__}.load: {path} is not valid {path.suffix[1:]}: {err}") from None
        if not isinstance(values, (dict, type(None))):
            raise ValueError(f"{cls.__name__}.load: {path} must hold a mapping of fields")
        return cls.from_dict(values or {})

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """One flag per field (``--field-name``) with default None, so that the flags given can be told apart."""
        defaults = cls()
        for f in fields(cls):
            if f.name in skip:
                continue
            value, flag = getattr(defaults, f.name), "--" + f.name.replace("_", "-")
            if isinstance(value, tuple):
                kind = type(value[0]) if value else str
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


def _parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
