"""A command group that imports a subcommand's module only when that subcommand runs.

Why: ``kvstore serve`` needs the server, ``kvstore bench`` needs torch, numba and every benchmark, ``kvstore
--version`` needs none of it. A group that imports all its commands up front made ``--version`` take 6.5 s, and a
Ctrl-C during those seconds escaped ``main``'s handler as a 30-line ``KeyboardInterrupt`` traceback. Here
each command is named by its module and attribute; the import runs inside ``main``, where an interrupt is one line.

``kvstore --help`` lists the commands from their one-line summaries, kept next to the names, without importing them;
``tests/cli/test_lazy_group.py`` checks each summary against the command's own docstring.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from difflib import get_close_matches
from typing import ClassVar

import typer
from typer import _click
from typer.core import TyperGroup

__all__ = ["LazyCommand", "LazyGroup"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LazyCommand:
    """Where a subcommand lives and what ``--help`` says of it before it is imported.

    Attributes:
        module: the module that defines it (``kvstore.cli.serve``).
        attribute: a typer command function or a ``typer.Typer`` (a group of subcommands) in that module.
        summary: the first line of its help, shown in the parent's command list.
    """

    module: str
    attribute: str
    summary: str

    def load(self, name: str) -> _click.Command:
        """Import the module and build the click command, named ``name``."""
        target = getattr(importlib.import_module(self.module), self.attribute)
        if isinstance(target, typer.Typer):
            group = typer.main.get_group(target)
            group.name = name
            return group
        single = typer.Typer(rich_markup_mode=None, add_completion=False)
        single.command(name)(target)
        return typer.main.get_command(single)


class LazyGroup(TyperGroup):
    """A typer group whose subcommands are :class:`LazyCommand` s, loaded on first use and kept.

    Subclasses set ``lazy_commands`` (name -> where it lives), in the order ``--help`` lists them.
    """

    lazy_commands: ClassVar[Mapping[str, LazyCommand]] = {}

    def list_commands(self, ctx: _click.Context) -> list[str]:
        return list(self.lazy_commands)

    def get_command(self, ctx: _click.Context, cmd_name: str) -> _click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy_commands:
            self.commands[cmd_name] = self.lazy_commands[cmd_name].load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def resolve_command(
        self, ctx: _click.Context, args: list[str]
    ) -> tuple[str | None, _click.Command | None, list[str]]:
        """As typer's, with "Did you mean" drawn from every command, loaded or not."""
        try:
            return super().resolve_command(ctx, args)
        except _click.exceptions.UsageError as exc:
            matches = get_close_matches(args[0], self.list_commands(ctx))
            if matches and "Did you mean" not in exc.message:
                exc.message = f"{exc.message.rstrip('.')}. Did you mean {', '.join(map(repr, matches))}?"
            raise

    def format_commands(self, ctx: _click.Context, formatter: _click.HelpFormatter) -> None:
        """List every command with its summary, importing none of them."""
        with formatter.section("Commands"):
            formatter.write_dl([(name, command.summary) for name, command in self.lazy_commands.items()])
