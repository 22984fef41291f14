"""``kvstore serve``'s settings are declared once (``ServeFlags``' fields): its options, its config-file keys and
variables, and docs/settings.md's table all follow that declaration, and these tests fail where one does not."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from typer import _click  # typer vendors click
from typer.core import TyperOption

from kvstore.cli.declared_options import GivenValues
from kvstore.cli.serve import serve_command, serve_options
from kvstore.server.serve_sources import ServeFlags, serve_settings

REPO_ROOT = Path(__file__).resolve().parents[2]


def serve_click_command() -> _click.Command:
    app = typer.Typer(rich_markup_mode=None, add_completion=False)
    app.command("serve")(serve_command)
    return typer.main.get_command(app)


def test_every_setting_is_an_option_with_its_declared_flag_type_and_help() -> None:
    options = {parameter.name: parameter for parameter in serve_click_command().params}
    settings = serve_settings()
    assert list(options) == [setting.name for setting in settings] + ["config", "exit_with_pid"]
    for setting in settings:
        option = options[setting.name]
        assert isinstance(option, TyperOption), setting.name
        assert option.help == setting.help_text, setting.name
        assert option.default is None, f"{setting.flag}: None (not given) lets the environment and file decide"
        if setting.kind is bool:
            assert option.opts == [setting.flag] and option.secondary_opts == [setting.declaration.split("/")[1]]
        else:
            assert option.opts == [setting.flag] and option.secondary_opts == []


def test_the_options_build_serve_flags_field_by_field(tmp_path: Path) -> None:
    """Each option's value lands in its own field (a flag given on the command line reaches check_flags)."""
    arguments = ["--tiers", "cpu", "--cpu-size", "1GiB", "--data-dir", str(tmp_path), "--disable-blend", "--port", "7"]
    values = serve_click_command().make_context("serve", arguments).params
    flags = GivenValues(serve_options(), values).build(ServeFlags)
    assert flags == ServeFlags(tiers="cpu", cpu_size="1GiB", data_dir=tmp_path, enable_blend=False, port=7)


def docs_serve_table() -> list[tuple[str, str]]:
    """docs/settings.md's ``kvstore serve`` rows: (flag column, config-key column), in order."""
    text = (REPO_ROOT / "docs/settings.md").read_text()
    return re.findall(r"^\| `(--[^`]+)` / `(\w+)` \|", text, re.M)


def test_the_docs_table_lists_every_setting_in_the_declared_order_and_spelling() -> None:
    declared = [(setting.declaration, setting.name) for setting in serve_settings()]
    assert docs_serve_table() == declared


def test_the_docs_table_header_spells_the_variables_as_env_name_does() -> None:
    text = (REPO_ROOT / "docs/settings.md").read_text()
    assert "| flag / config key (variable: `KVSTORE_` + the key in capitals) |" in text
    assert all(setting.env == "KVSTORE_" + setting.name.upper() for setting in serve_settings())
