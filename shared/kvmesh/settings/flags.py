"""Flags with an environment variable behind them: a flag given beats its ``KVMESH_*``
variable, which beats the default; a value that does not parse, from either, is one CLI
error line (``prog: error: ...``), as argparse says it for a flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, NoReturn, TypeVar

from kvmesh.settings.env import EnvError, EnvVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _EnvOption:
    dest: str
    env: EnvVar | None
    default: Any
    convert: Callable[[str], Any]
    choices: tuple[Any, ...] | None = None


class SettingsParser(argparse.ArgumentParser):
    """``argparse`` whose options (``option``) fall back to their variable, then their default."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._env_options: list[_EnvOption] = []

    def error(self, message: str) -> NoReturn:
        """One line (``prog: error: ...``) and exit code 2: no usage block before it."""
        self.exit(2, f"{self.prog}: error: {message}\n")

    def option(
        self,
        *flags: str,
        env: EnvVar | None = None,
        default: Any = None,
        from_env: Callable[[str], Any] | None = None,
        group: argparse._ArgumentGroup | None = None,
        **kwargs: Any,
    ) -> argparse.Action:
        """A flag read from ``env`` when not given (``from_env`` reads the variable's text;
        by default the flag's own ``type``); ``%(default)s`` in its help is ``default``."""
        if "help" in kwargs and kwargs["help"] is not argparse.SUPPRESS:
            kwargs["help"] = kwargs["help"].replace("%(default)s", str(default))
        action = (group or self).add_argument(*flags, default=argparse.SUPPRESS, **kwargs)
        convert = from_env or action.type or str
        assert callable(convert) and not (env is not None and action.nargs == 0 and from_env is None), flags
        choices = tuple(action.choices) if action.choices is not None else None
        self._env_options.append(_EnvOption(action.dest, env, default, convert, choices))  # type: ignore[arg-type]
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        for option in self._env_options:
            if hasattr(parsed, option.dest):
                continue  # given as a flag
            try:
                value = option.default if option.env is None else option.env.read(option.convert, option.default)
            except EnvError as exc:
                self.error(str(exc))
            if option.choices is not None and value not in option.choices:  # as argparse checks a flag's
                assert option.env is not None
                choose = ", ".join(map(repr, option.choices))
                self.error(f"{option.env.name}={option.env.raw()!r}: invalid choice: {value!r} (choose from {choose})")
            setattr(parsed, option.dest, value)
        return parsed, extras


def switch(text: str) -> bool:
    """A variable that turns a flag on: 1, true, yes or on."""
    return text.strip().lower() in ("1", "true", "yes", "on")


def from_args(cls: type[T], args: argparse.Namespace, **computed: Any) -> T:
    """``cls`` with each field the flag of its name gave (``computed``: those no flag gives
    as it is); a field neither names keeps its default."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}  # type: ignore[arg-type]
    return cls(**(values | computed))
