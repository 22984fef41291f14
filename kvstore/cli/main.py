"""The ``kvstore`` command: one typer app, subcommands registered from their own modules.

Errors reach the user as one line on stderr and a non-zero exit: 2 for bad arguments, 1 for a kvstore error (bad
data dir, layout mismatch, ...), 3 for a bug (the traceback goes to the log at DEBUG, run with
``--log-level debug`` to see it). A traceback printed to a user is a bug.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import typer
from typer._click.exceptions import ClickException, NoSuchOption  # typer vendors click: its usage errors

from kvstore.cli.bench import bench_app
from kvstore.cli.demo import demo_command
from kvstore.cli.evict import evict_command
from kvstore.cli.inspect import inspect_command
from kvstore.cli.serve import serve_command
from kvstore.errors import KVStoreError
from kvstore.version import DISTRIBUTION, __version__

__all__ = ["app", "main"]

logger = logging.getLogger(__name__)

RENAMED_OPTIONS = {"--disk-path": "--data-dir", "--path": "--data-dir"}
"""Options of earlier releases, and what replaced them: a user with an old command line is told the new name."""

app = typer.Typer(
    name="kvstore",
    help="kvstore: a tiered KV-cache store for LLM serving (gpu / cpu / LMDB+zstd disk).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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


app.command("inspect")(inspect_command)
app.command("evict")(evict_command)
app.command("demo")(demo_command)
app.command("serve")(serve_command)
app.add_typer(bench_app, name="bench")


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point: run the app and turn every failure into one line and an exit code."""
    command = typer.main.get_command(app)
    try:
        result = command.main(args=list(argv) if argv is not None else None, prog_name="kvstore", standalone_mode=False)
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
        _fail("kvstore: interrupted", 130)
    except Exception as exc:  # the last boundary before a user: log the traceback, print one line
        logger.debug("unexpected error", exc_info=True)
        _fail(f"kvstore: internal error: {type(exc).__name__}: {exc} (rerun with --log-level debug)", 3)
    sys.exit(result if isinstance(result, int) else 0)


def _fail(message: str, code: int) -> None:
    typer.echo(message, err=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
