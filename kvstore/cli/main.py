"""The ``kvstore`` command: one typer app, subcommands registered from their own modules.

Errors reach the user as one line on stderr and a non-zero exit: 2 for bad arguments, 1 for a kvstore error (bad
data dir, layout mismatch, ...), 3 for a bug (the traceback goes to the log at DEBUG, run with
``--log-level debug`` to see it). A traceback printed to a user is a bug.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping, Sequence
from typing import ClassVar

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError, NoSuchOption  # typer vendors click

from kvstore.cli.lazy_group import LazyCommand, LazyGroup
from kvstore.errors import KVStoreError
from kvstore.version import DISTRIBUTION, __version__

__all__ = ["app", "main"]

logger = logging.getLogger(__name__)

_INTERRUPTED_EXIT_CODE = 130
"""Ctrl-C's exit status (128 + SIGINT), as shells report it."""

RENAMED_OPTIONS = {"--disk-path": "--data-dir", "--path": "--data-dir"}
"""Options of earlier releases, and what replaced them: a user with an old command line is told the new name."""


class _Commands(LazyGroup):
    """kvstore's subcommands, each imported when it runs (``--version`` and ``--help`` import none of them)."""

    lazy_commands: ClassVar[Mapping[str, LazyCommand]] = {
        "inspect": LazyCommand(
            module="kvstore.cli.inspect",
            attribute="inspect_command",
            summary="Summarise a data dir (chunks, bytes, compression ratio, layout, oldest/newest access) or a "
            "running server.",
        ),
        "evict": LazyCommand(
            module="kvstore.cli.evict",
            attribute="evict_command",
            summary="Drop chunks by key, by bytes to free, or all of them.",
        ),
        "demo": LazyCommand(
            module="kvstore.cli.demo",
            attribute="demo_command",
            summary="Store KV, restart, look up, retrieve and inspect, on an embedded data dir.",
        ),
        "serve": LazyCommand(
            module="kvstore.cli.serve",
            attribute="serve_command",
            summary="Serve a tiered KV store to engines on this host (shared memory) or the network (inline bytes).",
        ),
        "bench": LazyCommand(
            module="kvstore.cli.bench",
            attribute="bench_app",
            summary="Benchmarks; each figure comes with a same-run baseline and ratio.",
        ),
    }


app = typer.Typer(
    cls=_Commands,
    name="kvstore",
    help="""kvstore: a tiered KV-cache store for LLM serving (gpu / cpu / LMDB+zstd disk).

    Examples:

        kvstore serve --data-dir ./kvstore-data

        kvstore inspect --data-dir ./kvstore-data

        kvstore inspect --url tcp://127.0.0.1:5555

        kvstore demo --data-dir ./kvstore-data

        kvstore bench tiers --tiers cpu,disk

        kvstore serve --help
    """,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: rich's tables cut long flag names at 80 columns
)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"kvstore {__version__} (distribution {DISTRIBUTION})")
        raise typer.Exit(0)


@app.callback()
def _configure(
    log_level: str = typer.Option("warning", "--log-level", help="debug, info, warning or error."),
    version: bool = typer.Option(
        False, "--version", help="Print the version and exit.", callback=_print_version, is_eager=True
    ),
) -> None:
    level = logging.getLevelName(log_level.upper())
    if not isinstance(level, int):
        raise typer.BadParameter(f"--log-level {log_level!r}: use debug, info, warning or error")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: run the app and turn every failure into one line and an exit code."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=list(argv) if argv is not None else None, prog_name="kvstore", standalone_mode=False)
    except NoArgsIsHelpError as exc:  # `kvstore` or `kvstore bench` alone: the help, as click shows it, no "error:"
        _fail(exc.format_message(), 2)
    except NoSuchOption as exc:
        renamed = RENAMED_OPTIONS.get(exc.option_name)
        message = f"{exc.option_name} was renamed {renamed}" if renamed else exc.format_message()
        _fail(f"kvstore: error: {message}", 2)
    except ClickException as exc:
        _fail(f"kvstore: error: {exc.format_message()}", 2)
    except KVStoreError as exc:
        _fail(f"kvstore: error: {exc}", 1)
    except typer.Abort:
        _fail("kvstore: aborted", 1)
    except KeyboardInterrupt:
        _fail("kvstore: interrupted", _INTERRUPTED_EXIT_CODE)
    except Exception as exc:  # the last boundary before a user: log the traceback, print one line
        logger.debug("unexpected error", exc_info=True)
        _fail(f"kvstore: internal error: {type(exc).__name__}: {exc} (rerun with --log-level debug)", 3)
    if result == _INTERRUPTED_EXIT_CODE:  # typer returns a KeyboardInterrupt in a command as this code, silently
        _fail("kvstore: interrupted", _INTERRUPTED_EXIT_CODE)
    sys.exit(result if isinstance(result, int) else 0)


def _fail(message: str, code: int) -> None:
    typer.echo(message, err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
