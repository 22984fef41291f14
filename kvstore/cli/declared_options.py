"""A command's options declared once, as a table, and the typer command built from it.

Why: a long option list written as a typer signature repeats each option three times (the parameter, its
``typer.Option`` and its keyword where the options dataclass is built), and the three drift. Here each option is one
``CliOption``: its flag, type and help, and the options-dataclass fields it fills, whose defaults are its default.
``declared_command`` turns a table into a typer command whose callback receives the parsed values as one
``GivenValues``; ``GivenValues.build`` makes an options dataclass from the fields the table maps to it.

Imports only typer (``--help`` and a refused option must stay light). Pure functions, no state.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import typer

__all__ = ["CliOption", "GivenValues", "OptionTarget", "declared_command", "target_default"]

_Options = TypeVar("_Options")


@dataclass(frozen=True, slots=True, kw_only=True)
class OptionTarget:
    """A field of an options dataclass that an option's value fills.

    Attributes:
        options_class: the dataclass (``VllmBenchOptions``).
        field_name: its field (``num_prompts``).
    """

    options_class: type
    field_name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CliOption:
    """One option of a command.

    Attributes:
        name: the callback's parameter, the key of its value in ``GivenValues``.
        declaration: the flag as typer takes it (``--port``, ``--enable-blend/--disable-blend``).
        annotation: its type (``int``, ``Path | None``): typer's conversion and ``--help``'s metavar.
        help_text: its ``--help`` line.
        targets: the options-dataclass fields it fills; the first one's default is its default.
        default: its default when it has no target.
    """

    name: str
    declaration: str
    annotation: object
    help_text: str
    targets: tuple[OptionTarget, ...] = ()
    default: object = None

    @property
    def flag(self) -> str:
        """The first spelling of the flag (``--enable-blend`` of ``--enable-blend/--disable-blend``)."""
        return self.declaration.split("/")[0]

    def default_value(self) -> object:
        """The default: the first target's field default, else ``default``."""
        return target_default(self.targets[0]) if self.targets else self.default


def target_default(target: OptionTarget) -> object:
    """The default of ``target``'s field as its option takes it: an enum's value (``"preamble"``), else the default
    itself (a dataclass field without one is a mistake in the table)."""
    (found,) = (field for field in dataclasses.fields(target.options_class) if field.name == target.field_name)
    assert found.default is not dataclasses.MISSING, f"{target.field_name} has no default to offer its option"
    return found.default.value if isinstance(found.default, enum.Enum) else found.default


@dataclass(frozen=True, slots=True)
class GivenValues:
    """The values a declared command was called with, by option name, and the table that declared them."""

    options: Sequence[CliOption]
    values: Mapping[str, object]

    def __getitem__(self, name: str) -> Any:
        """The value of option ``name`` (typed as its declaration; typer has converted it)."""
        return self.values[name]

    def switch(self, name: str) -> bool:
        """The value of a boolean option."""
        value = self.values[name]
        assert isinstance(value, bool), f"option {name} is declared as a bool"
        return value

    def path(self, name: str) -> Path | None:
        """The value of a ``Path | None`` option."""
        value = self.values[name]
        assert value is None or isinstance(value, Path), f"option {name} is declared as a Path"
        return value

    def build(self, options_class: Callable[..., _Options], **overrides: object) -> _Options:
        """An ``options_class`` from the values of the options that target it, then ``overrides`` (a converted value,
        a field no option fills); the dataclass checks them."""
        fields: dict[str, object] = {
            target.field_name: self.values[option.name]
            for option in self.options
            for target in option.targets
            if target.options_class is options_class
        }
        return options_class(**{**fields, **overrides})


def declared_command(options: Sequence[CliOption], run: Callable[[GivenValues], None], doc: str) -> Callable[..., None]:
    """A typer command taking ``options`` (in their order) that calls ``run`` with the values; ``doc`` is its help."""

    def command(**values: object) -> None:
        run(GivenValues(options, values))

    parameters = [
        inspect.Parameter(
            option.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=typer.Option(option.default_value(), option.declaration, help=option.help_text),
            annotation=option.annotation,
        )
        for option in options
    ]
    command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    command.__doc__ = doc
    return command
