"""The flags of a command's config: each setting is declared once, as a field, and its flag is derived from it.

A field of a msgspec config (``RolloutConfig``, ``TrainerConfig``, ``EngineConfig``, ``DemoConfig``) carries its
type, default, constraints and help (``Meta(description=...)``); ``ConfigFlags(kind)`` gives a typer command one
flag per field, ``--field-name`` unless ``SHARED_FLAGS`` or the command's overrides name it otherwise (the public
names that predate this, aliases, environment variables). Parsing is one call, ``ConfigFlags.parse``: the
``--config`` file, then the flags given, validated by the config's own type; a mistake is one ``error:`` line
naming the flag, exit 2.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final, Generic, Literal, TypeVar

import msgspec
import typer
from msgspec import Meta

from weightbus.bus.options import NATS_URL_ENV
from weightbus.cli.checks import check_nats_url, check_port
from weightbus.cli.exits import EXIT_USAGE, fail
from weightbus.cli.options import POLICY_ENV
from weightbus.errors import ConfigError
from weightbus.rl.config import load_config, make_config

__all__ = ["CONFIG_FILE_PARAM", "SHARED_FLAGS", "ConfigFlags", "FieldFlag", "Flag", "field_flags"]

C = TypeVar("C", bound=msgspec.Struct)
T = TypeVar("T")

#: The name of the ``--config FILE`` parameter (``cli.connection`` reads it to rank the file above a context).
CONFIG_FILE_PARAM: Final = "config_file"


@dataclass(frozen=True)
class Flag:
    """How a field's flag differs from the derived ``--field-name``.

    Attributes:
        names: the flag's names, the long one first (empty: ``--field-name``).
        envvar: environment variables read when the flag is not given, first set wins.
        callback: a typer check of the value given (it ends the command with one ``error:`` line).
        path: the flag takes a path (typer's ``Path``) for a ``str`` field, as ``--out`` does on every command.
    """

    names: tuple[str, ...] = ()
    envvar: tuple[str, ...] = ()
    callback: Callable[[Any], Any] | None = None
    path: bool = False


#: The flags that mean one thing on every command, whichever config declares the field.
SHARED_FLAGS: Final[Mapping[str, Flag]] = {
    "nats_url": Flag(("--nats", "--server", "-s"), envvar=NATS_URL_ENV, callback=check_nats_url),
    "policy": Flag(("--policy", "-p"), envvar=(POLICY_ENV,)),
    "router_url": Flag(("--router",)),
    "metrics_port": Flag(callback=check_port),
    "metrics_host": Flag(envvar=("WEIGHTBUS_METRICS_HOST",)),
}


@dataclass(frozen=True)
class FieldFlag:
    """One field's flag, derived from the field (``ConfigFlags.flags``).

    Attributes:
        field: the config field.
        names: the flag's names, the long one first.
        type: what the flag parses (``int``, ``float``, ``str``, ``bool``, or ``Path`` for a ``str`` field).
        choices: the values a ``Literal`` field allows, else empty.
        default: the field's default (``msgspec.NODEFAULT`` for a required field).
        help: the field's description, with its default.
        envvar: the environment variables read when the flag is not given.
        callback: a typer check of the value given.
    """

    field: str
    names: tuple[str, ...]
    type: type
    choices: tuple[str, ...]
    default: Any
    help: str
    envvar: tuple[str, ...] = ()
    callback: Callable[[Any], Any] | None = None

    def value(self, given: Any) -> Any:
        """The field's value for what typer parsed (a path as the ``str`` the config holds)."""
        return str(given) if isinstance(given, Path) else given

    @property
    def flag(self) -> str:
        """The long name, as errors name the flag."""
        return self.names[0]

    def parameter(self) -> inspect.Parameter:
        """The flag as a keyword parameter of a typer command (None when not given, so the file's value stays)."""
        names = self.names
        if self.type is bool and len(names) == 1:
            names = (f"{names[0]}/--no-{names[0].removeprefix('--')}",)
        callback = self.callback if not self.choices else _choice(self.flag, self.choices)
        option = typer.Option(
            *names,
            help=self.help,
            envvar=self.envvar[0] if len(self.envvar) == 1 else list(self.envvar) or None,
            show_envvar=bool(self.envvar),
            show_default=False,
            metavar="|".join(self.choices) if self.choices else None,
            callback=callback,
        )
        return inspect.Parameter(
            self.field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[self.type | None, option]
        )


def _choice(flag: str, allowed: tuple[str, ...]) -> Callable[[str | None], str | None]:
    def check(value: str | None) -> str | None:
        if value is not None and value not in allowed:
            raise fail(f"{flag} must be {', '.join(allowed[:-1])} or {allowed[-1]}, not {value!r}", EXIT_USAGE)
        return value

    return check


def _shape(hint: Any) -> tuple[type, tuple[str, ...], str]:
    """A field's flag type, its choices and its description, from its (``Annotated``, optional) type."""
    description = ""
    while True:
        origin = typing.get_origin(hint)
        if origin is Annotated:
            base, *extras = typing.get_args(hint)
            for meta in extras:
                if isinstance(meta, Meta) and meta.description and not description:
                    description = meta.description  # the outermost (the field's own) wins
            hint = base
        elif origin in (typing.Union, types.UnionType):
            (hint,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        elif origin is Literal:
            choices = typing.get_args(hint)
            if not all(isinstance(choice, str) for choice in choices):
                raise TypeError(f"a config field of type {hint!r} has no flag type (choices are strings)")
            return str, choices, description
        elif hint in (bool, int, float, str):
            return hint, (), description
        else:
            raise TypeError(f"a config field of type {hint!r} has no flag type")


def _help(description: str, default: Any, flag: str) -> str:
    text = description.replace("``", "")
    if default is msgspec.NODEFAULT:
        return f"{text} (required)"
    if isinstance(default, bool):
        default = flag if default else "--no-" + flag.removeprefix("--")
    return text if default is None else f"{text} (default: {default})"


def field_flags(kind: type[msgspec.Struct], overrides: Mapping[str, Flag | None]) -> tuple[FieldFlag, ...]:
    """One flag per field of ``kind``: ``--field-name`` unless ``overrides`` (then ``SHARED_FLAGS``) says
    otherwise; a field whose override is None has no flag.

    Raises:
        TypeError: a field's type has no flag type, or an override names no field of ``kind``.
    """
    fields = {f.name: f for f in msgspec.structs.fields(kind)}
    unknown = set(overrides) - set(fields)
    if unknown:
        raise TypeError(f"{kind.__name__} has no field {', '.join(sorted(unknown))}")
    hints = typing.get_type_hints(kind, include_extras=True)
    flags = []
    for name, info in fields.items():
        override = overrides[name] if name in overrides else SHARED_FLAGS.get(name, Flag())
        if override is None:
            continue
        flag_type, choices, description = _shape(hints[name])
        if not description:
            raise TypeError(f"{kind.__name__}.{name} has no Meta(description=...): its flag would have no help")
        names = override.names or ("--" + name.replace("_", "-"),)
        if override.path:
            if flag_type is not str:
                raise TypeError(f"{kind.__name__}.{name} is not a str: its flag cannot take a path")
            flag_type = Path
        flags.append(
            FieldFlag(
                field=name,
                names=names,
                type=flag_type,
                choices=choices,
                default=info.default,
                help=_help(description, info.default, names[0]),
                envvar=override.envvar,
                callback=override.callback,
            )
        )
    return tuple(flags)


class ConfigFlags(Generic[C]):
    """A command's config as flags: ``@ConfigFlags(kind)`` hands the command ``config: kind`` parsed from them.

    Args:
        kind: the config type; each field gets one flag (``field_flags``).
        overrides: field -> how its flag differs (None: the field has no flag), above ``SHARED_FLAGS``.
        config_file: whether the command also takes ``--config FILE`` (the flags given override its fields).
        check: checks the config's type cannot make, given the config and ``where`` (how to name a field);
            raises ``ConfigError``.
    """

    def __init__(
        self,
        kind: type[C],
        overrides: Mapping[str, Flag | None] | None = None,
        *,
        config_file: bool = True,
        check: Callable[[C, Callable[[str], str]], None] | None = None,
    ) -> None:
        self.kind = kind
        self.flags = field_flags(kind, overrides or {})
        self.config_file = config_file
        self._check = check
        self._by_field = {f.field: f for f in self.flags}

    def where(self, field: str) -> str:
        """How an operator names ``field``: its flag, and the ``--config`` key where the command reads a file."""
        flag = self._by_field.get(field)
        if not self.config_file:
            return flag.flag if flag is not None else field
        return f'{flag.flag} (or "{field}" in --config)' if flag is not None else f'"{field}" in --config'

    def parse(self, config_file: Path | None, given: Mapping[str, Any]) -> C:
        """The config: ``config_file``'s fields (or the defaults), then every ``given`` value that is not None.

        Raises:
            typer.Exit: (code 2, after one ``error:`` line naming the flag) the config is missing a field, has an
                unknown one, or a value is out of range.
        """
        try:
            base = load_config(config_file, self.kind) if config_file is not None else None
            config = make_config(self.kind, base, **given)
            if self._check is not None:
                self._check(config, self.where)
            return config
        except ConfigError as exc:
            raise fail(self._message(str(exc)), EXIT_USAGE) from None

    def _message(self, message: str) -> str:
        """msgspec names a field by its JSON path; the operator typed a flag."""
        for flag in self.flags:
            if f"missing required field `{flag.field}`" in message:
                sources = [*flag.envvar, *([f'"{flag.field}" in --config'] if self.config_file else [])]
                return f"{flag.flag} is required" + (f" (or {', or '.join(sources)})" if sources else "")
        for field in (f.name for f in msgspec.structs.fields(self.kind)):
            at = f" - at `$.{field}`"
            if at in message:
                before, _, after = message.partition(at)
                return f"{self.where(field)}: {before}{after}"
        return message

    def __call__(self, command: Callable[..., T]) -> Callable[..., T]:
        """Give ``command`` (which takes ``config``) the flags, and ``--config`` where it reads a file."""
        signature = inspect.signature(command, eval_str=True)
        # Typer calls a command with keywords only: the config's flags come first in --help, then the command's own.
        params = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values() if p.name != "config"
        ]
        taken = {p.name for p in params} & {f.field for f in self.flags}
        if taken:
            raise TypeError(f"{command.__name__} has parameters named like fields of {self.kind.__name__}: {taken}")
        added = [f.parameter() for f in self.flags]
        if self.config_file:
            added.insert(0, _config_file_parameter())

        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> T:
            path = kwargs.pop(CONFIG_FILE_PARAM, None)
            given = {f.field: f.value(kwargs.pop(f.field, None)) for f in self.flags}
            kwargs["config"] = self.parse(path, given)
            return command(*args, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=[*added, *params])  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in wrapper.__signature__.parameters.values()}  # type: ignore[attr-defined]
        return wrapper


def _config_file_parameter() -> inspect.Parameter:
    option = typer.Option("--config", exists=True, help="JSON file of the command's config (flags given override it).")
    return inspect.Parameter(
        CONFIG_FILE_PARAM, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[Path | None, option]
    )
