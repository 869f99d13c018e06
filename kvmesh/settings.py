"""Settings declared once: each is a dataclass field with its default, its help and its flag.

A table of settings (the daemon's `DaemonConfig`, the network's `Policy`, `kvmesh serve`'s
`ServeOptions`) is a frozen dataclass whose fields are made with `setting(...)`. Everything else is
derived from those fields, so a default, a help text or a name is written in one place: the keys
a TOML file may hold, the `KVMESH_<NAME>` environment variables, the command-line flags and their
help (which states the default), and the conversion of each value to the field's type.
"""

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvmesh.errors import ConfigError


def setting(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    flag: str = "",
    metavar: str = "",
    choices: tuple[str, ...] = (),
    const: str = "",
    factory: Any = None,
) -> Any:
    """A field of a settings table. `flag`: its option, when not `--<name>` (a tuple's flag is
    repeated, one value each; a True-by-default bool's flag turns it off). `choices`: the values
    allowed (`check_choices` enforces them wherever the value came from). `const`: the value of the
    flag given without one (`--compress` alone). `factory`: a default computed when the table is made
    (a platform directory); `help` then says what it is."""
    metadata = {"help": help, "flag": flag, "metavar": metavar, "choices": choices, "const": const}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def settings_of(table: type) -> dict[str, dataclasses.Field]:
    """The fields of a settings table that are settings (made with `setting`), by name."""
    return {f.name: f for f in dataclasses.fields(table) if "help" in f.metadata}


def check_choices(table: Any) -> None:
    """A ConfigError for a setting of this table's instance outside its choices."""
    for name, f in settings_of(type(table)).items():
        choices, value = f.metadata["choices"], getattr(table, name)
        if choices and value not in choices:
            raise ConfigError(f"{name} must be {', '.join(choices[:-1])} or {choices[-1]}, not {value!r}")


def _kind(table: type, name: str) -> Any:
    """The type a setting's values take: its annotation, without `| None`."""
    kind = typing.get_type_hints(table)[name]
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    return kind


def convert(table: type, name: str, value: Any, source: str, *, typed: bool = False) -> Any:
    """A value from a file, the environment or a flag, as the setting's type; a bad one is a
    ConfigError naming where it came from. Lists may be given as comma-separated text. `typed`:
    the value comes with a type of its own (TOML's), which must be the setting's: `port = "80"` is
    a mistake in a file, while every environment variable is text."""
    kind = _kind(table, name)
    try:
        if typed and kind in (bool, int, float, str) and not isinstance(value, TOML_TYPES[kind]):
            raise TypeError(f"expected {TOML_NAMES[kind]}")
        if typing.get_origin(kind) is tuple:
            items = value.split(",") if isinstance(value, str) else value
            if not isinstance(items, (list, tuple)):
                raise TypeError("expected a list")
            return tuple(str(v).strip() for v in items if str(v).strip())
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).lower()
            if text not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError("expected true or false")
            return text in ("1", "true", "yes", "on")
        if kind is Path:
            return Path(value).expanduser()
        if kind in (int, float) and isinstance(value, bool):
            raise TypeError("expected a number")
        if kind is int and isinstance(value, float):
            raise TypeError("expected a whole number")
        if kind is str and not isinstance(value, str):
            raise TypeError("expected text")
        return kind(value)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{source}: bad value {value!r} for {name}: {e}") from None


# The TOML values a setting of each type takes (an integer is a fine float).
TOML_TYPES: dict[type, tuple[type, ...]] = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}
TOML_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "text in quotes"}


def from_table(table: type, data: Mapping[str, Any], source: str, *, allowed: Iterable[str] = ()) -> dict[str, Any]:
    """The settings a file's table gives (names with - or _), converted; an unknown key is an error
    listing the known ones. `allowed`: further keys another table reads from the same place."""
    known = settings_of(table)
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in allowed:
            continue
        if name not in known:
            names = ", ".join(sorted({*known, *allowed}))
            raise ConfigError(f"{source}: unknown setting {key!r}; known: {names}")
        values[name] = convert(table, name, value, source, typed=True)
    return values


def from_environment(table: type, env: Mapping[str, str]) -> dict[str, Any]:
    """The settings given as KVMESH_<NAME> variables, converted."""
    values = {}
    for name in settings_of(table):
        variable = f"KVMESH_{name.upper()}"
        if (value := env.get(variable)) is not None:
            values[name] = convert(table, name, value, variable)
    return values


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def describe_default(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING:
        return ""
    value = f.default
    if isinstance(value, tuple):
        return "" if not value else f" (default {', '.join(value)})"
    if isinstance(value, bool) or value is None or value == "":
        return ""
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f" (default {value:,}: {value >> 30} GiB)" if value % (1 << 30) == 0 else f" (default {value:,})"
    return f" (default {value})"


def add_flags(parser: argparse.ArgumentParser, table: type, *, skip: Iterable[str] = ()) -> None:
    """One flag per setting of `table`, its help ending with the default. Flags not given parse as
    None, so a flag overrides the file and the environment only when it is on the command line."""
    for name, f in settings_of(table).items():
        if name in skip:
            continue
        kind = _kind(table, name)
        help = f.metadata["help"].replace("%", "%%")
        if kind is bool:
            turns_off = f.default is True
            parser.add_argument(flag_of(f), dest=name, action="store_const", const=not turns_off, help=help)
        elif typing.get_origin(kind) is tuple:
            metavar = f.metadata["metavar"] or "VALUE"
            parser.add_argument(flag_of(f), dest=name, action="append", metavar=metavar, help=help + " [repeatable]")
        else:
            metavar = f.metadata["metavar"] or {int: "N", float: "X"}.get(kind, "VALUE")
            metavar = None if f.metadata["choices"] else metavar  # argparse shows {the,choices}
            alone = {"nargs": "?", "const": f.metadata["const"]} if f.metadata["const"] else {}
            parser.add_argument(
                flag_of(f),
                dest=name,
                type=kind,
                metavar=metavar,
                choices=f.metadata["choices"] or None,
                help=help + describe_default(f).replace("%", "%%"),
                **alone,
            )


def from_flags(table: type, args: argparse.Namespace, *, skip: Iterable[str] = ()) -> dict[str, Any]:
    """The settings given on the command line (those `add_flags` added), as parsed; a table's loader
    converts them with `from_overrides`."""
    return {
        name: getattr(args, name)
        for name in settings_of(table)
        if name not in skip and getattr(args, name, None) is not None
    }


def from_overrides(table: type, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The settings among `overrides` (flags, or a caller's values; None: not given), converted; a
    bad one is a ConfigError naming its flag."""
    known = settings_of(table)
    return {
        name: convert(table, name, value, flag_of(known[name]))
        for name, value in overrides.items()
        if value is not None and name in known
    }


def unknown_names(overrides: Mapping[str, Any], *tables: type) -> None:
    """A TypeError for an override that names no setting of `tables`: a caller's mistake, never ignored."""
    known = {name for table in tables for name in settings_of(table)}
    if unknown := sorted(set(overrides) - known):
        raise TypeError(f"no such setting: {', '.join(unknown)}")
