"""The embedded server's settings are ``kvstore serve`` settings under the same names: each ``EmbeddedServerSettings``
field is a ``ServeFlags`` setting (or ``--config``) of a matching type, and the flags ``serve_flags`` writes are ones
``kvstore serve`` takes. ``kvstore.connectors`` may not import the server, so this test holds the two together."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import typer

from kvstore.cli.serve import serve_command
from kvstore.connectors.settings import EmbeddedServerSettings, parse_connector_settings
from kvstore.server.serve_sources import serve_settings

EMBEDDED_VALUES = {
    "data_dir": "/nvme/kv",
    "tiers": "cpu,disk,remote",
    "cpu_size": "8GiB",
    "gpu_size": "1GiB",
    "disk_size": "500GiB",
    "chunk_size": 16,
    "chunking": "content",
    "chunk_separator": [198, 198],
    "config": "kvstore.toml",
    "remote_url": "valkey://cache:6379",
    "remote_namespace": "fleet-a",
    "kv_events": "tcp://*:5557",
    "kv_events_replay": "tcp://*:5558",
}


def test_every_embedded_setting_is_a_serve_setting_of_its_type() -> None:
    declared = {setting.name: setting.kind for setting in serve_settings()} | {"config": Path}
    hints = typing.get_type_hints(EmbeddedServerSettings)
    for field in dataclasses.fields(EmbeddedServerSettings):
        assert field.name in declared, f"{field.name} is no kvstore serve setting"
        kinds = {kind for kind in typing.get_args(hints[field.name]) if kind is not type(None)} or {hints[field.name]}
        assert declared[field.name] in kinds, f"{field.name}: {kinds} against kvstore serve's {declared[field.name]}"


def test_every_embedded_key_is_exercised_here() -> None:
    names = {field.name for field in dataclasses.fields(EmbeddedServerSettings)} - {"enable_blend"}
    assert set(EMBEDDED_VALUES) == names


def test_kvstore_serve_takes_every_flag_the_embedded_server_is_given() -> None:
    settings = parse_connector_settings({f"kvstore.{name}": value for name, value in EMBEDDED_VALUES.items()})
    embedded = dataclasses.replace(settings.embedded, enable_blend=True)
    app = typer.Typer(rich_markup_mode=None, add_completion=False)
    app.command("serve")(serve_command)
    values = typer.main.get_command(app).make_context("serve", embedded.serve_flags()).params
    expected = {name: value for name, value in EMBEDDED_VALUES.items() if name != "chunk_separator"}
    assert {name: values[name] for name in expected} == {
        name: Path(str(value)) if name in ("data_dir", "config") else value for name, value in expected.items()
    }
    assert values["chunk_separator"] == "198,198" and values["enable_blend"] is True
