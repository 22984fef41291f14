"""``parse_connector_settings``: every ``kvstore.*`` key parsed into its type, and every bad key or value refused
with one line naming it, before anything starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from kvstore.config import DEFAULT_DATA_DIR
from kvstore.connectors.settings import (
    ConnectorSettings,
    EmbeddedServerSettings,
    default_engine_data_dir,
    parse_connector_settings,
    settle_data_dir,
)
from kvstore.errors import ConfigError
from kvstore.layout import KVDtype
from kvstore.presets import preset_layout

KNOWN_NAMES = (
    "url",
    "model_id",
    "lookup_timeout_s",
    "transfer_timeout_s",
    "retry_s",
    "async_disk_loads",
    "data_dir",
    "tiers",
    "cpu_size",
    "gpu_size",
    "disk_size",
    "chunk_size",
    "config",
)
EMBEDDED_VALUES: dict[str, object] = {
    "data_dir": "/nvme/kv",
    "tiers": "cpu,disk,remote",
    "cpu_size": "8GiB",
    "gpu_size": "1.5GiB",
    "disk_size": 500 * 2**30,
    "chunk_size": 16,
    "chunking": "content",
    "config": "kvstore.toml",
    "remote_url": "valkey://cache:6379",
    "remote_namespace": "fleet-a",
    "kv_events": "tcp://*:5557",
    "kv_events_replay": "tcp://*:5558",
}


def one_line_error(extra_config: dict[str, object], *fragments: str) -> str:
    """The ConfigError message for ``extra_config``, checked to be one line holding every fragment."""
    with pytest.raises(ConfigError) as raised:
        parse_connector_settings(extra_config)
    message = str(raised.value)
    assert "\n" not in message, message
    assert all(fragment in message for fragment in fragments), message
    return message


def test_no_config_gives_the_embedded_defaults() -> None:
    expected = ConnectorSettings()
    assert parse_connector_settings(None) == expected and parse_connector_settings({}) == expected
    assert expected.url is None and expected.embedded.data_dir is None  # the engine's layout names it
    assert (expected.lookup_timeout_s, expected.transfer_timeout_s, expected.retry_s) == (2.0, 30.0, 5.0)
    assert expected.async_disk_loads and expected.model_id is None


def test_the_default_data_dir_is_one_per_layout() -> None:
    """Engines of different models or KV dtypes get data dirs of their own under ./kvstore-data: a data dir holds one
    layout, and the README's samples leave ./kvstore-data holding SmolLM2 in bfloat16 while docs/vllm.md's engine
    runs it in float32."""
    bf16 = preset_layout("smollm2-135m")
    fp32 = dataclasses.replace(bf16, dtype=KVDtype.FLOAT32)
    served_path = dataclasses.replace(bf16, model_id="/models/cache/SmolLM2 135M (export)/")
    layouts = (bf16, fp32, served_path)
    dirs = {layout: settle_data_dir(ConnectorSettings(), layout).embedded.data_dir for layout in layouts}
    assert len(set(dirs.values())) == 3
    for layout, data_dir in dirs.items():
        assert data_dir is not None and data_dir.parent == DEFAULT_DATA_DIR
        assert data_dir.name.endswith(f"-{layout.dtype.value}-{layout.namespace.hex()[:8]}"), data_dir
    assert dirs[served_path] is not None and dirs[served_path].name.startswith("SmolLM2-135M-export-bfloat16-")
    assert settle_data_dir(ConnectorSettings(), bf16) == settle_data_dir(ConnectorSettings(), bf16)  # stable
    given = parse_connector_settings({"kvstore.data_dir": "/nvme/kv"})
    assert settle_data_dir(given, fp32).embedded.data_dir == Path("/nvme/kv")


def test_every_embedded_key_is_parsed_into_its_type() -> None:
    settings = parse_connector_settings(
        {f"kvstore.{name}": value for name, value in EMBEDDED_VALUES.items()}
        | {"kvstore.model_id": "org/model", "kvstore.lookup_timeout_s": 1, "kvstore.transfer_timeout_s": 2.5}
        | {"kvstore.retry_s": 7, "kvstore.async_disk_loads": False}
    )
    assert settings == ConnectorSettings(
        url=None,
        embedded=EmbeddedServerSettings(
            data_dir=Path("/nvme/kv"),
            tiers="cpu,disk,remote",
            cpu_size="8GiB",
            gpu_size="1.5GiB",
            disk_size=str(500 * 2**30),
            chunk_size=16,
            chunking="content",
            config=Path("kvstore.toml"),
            remote_url="valkey://cache:6379",
            remote_namespace="fleet-a",
            kv_events="tcp://*:5557",
            kv_events_replay="tcp://*:5558",
        ),
        model_id="org/model",
        lookup_timeout_s=1.0,
        transfer_timeout_s=2.5,
        retry_s=7.0,
        async_disk_loads=False,
    )
    embedded = settings.embedded
    assert isinstance(embedded.data_dir, Path) and isinstance(embedded.config, Path)
    assert type(embedded.cpu_size) is str and type(embedded.disk_size) is str
    assert type(settings.retry_s) is float and type(settings.lookup_timeout_s) is float
    assert type(embedded.chunk_size) is int


def test_a_url_configures_a_shared_server() -> None:
    settings = parse_connector_settings({"kvstore.url": "tcp://10.0.0.2:5555", "kvstore.retry_s": 0.5})
    assert settings.url == "tcp://10.0.0.2:5555" and settings.retry_s == 0.5
    assert settings.embedded == EmbeddedServerSettings()
    assert parse_connector_settings({"kvstore.url": "ipc:///tmp/kv.sock"}).url == "ipc:///tmp/kv.sock"


def test_serve_flags_name_every_given_setting() -> None:
    assert EmbeddedServerSettings(data_dir=Path("/d")).serve_flags() == ["--data-dir", "/d"]
    settings = parse_connector_settings({f"kvstore.{name}": value for name, value in EMBEDDED_VALUES.items()})
    assert settings.embedded.serve_flags() == [
        "--data-dir", "/nvme/kv",
        "--tiers", "cpu,disk,remote",
        "--cpu-size", "8GiB",
        "--gpu-size", "1.5GiB",
        "--disk-size", str(500 * 2**30),
        "--chunk-size", "16",
        "--chunking", "content",
        "--config", "kvstore.toml",
        "--remote-url", "valkey://cache:6379",
        "--remote-namespace", "fleet-a",
        "--kv-events", "tcp://*:5557",
        "--kv-events-replay", "tcp://*:5558",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("extra_config", "fragments"),
    [
        ({"kvstore.cpu_size_gb": 8}, ("'kvstore.cpu_size_gb'", "kvstore.cpu_size")),
        ({"kvstore.chunking": "rolling"}, ("kvstore.chunking must be one of fixed, content", "'rolling'")),
        ({"kvstore.chunking": 1}, ("kvstore.chunking must be one of fixed, content",)),
        ({"kvstore.": 1}, ("'kvstore.'",)),
        ({"kvstore.embedded": {}}, ("'kvstore.embedded'",)),
        ({"cpu_size": "8GiB"}, ("'cpu_size'", "kvstore.cpu_size")),
        ({"url": "tcp://127.0.0.1:5555"}, ("'url'",)),
        ({"KVSTORE.url": "tcp://127.0.0.1:5555"}, ("'KVSTORE.url'",)),
        ({"kvstore.cpu_size": True}, ("kvstore.cpu_size", "a size such as", "True")),
        ({"kvstore.cpu_size": 8.5}, ("kvstore.cpu_size", "a size such as", "8.5")),
        ({"kvstore.cpu_size": "8 gigs"}, ("kvstore.cpu_size", "is not a size", "8GiB")),
        ({"kvstore.retry_s": "5"}, ("kvstore.retry_s", "positive, finite number", "'5'")),
        ({"kvstore.lookup_timeout_s": -1}, ("kvstore.lookup_timeout_s", "positive, finite number", "-1")),
        ({"kvstore.transfer_timeout_s": 0}, ("kvstore.transfer_timeout_s", "positive, finite number")),
        ({"kvstore.retry_s": float("inf")}, ("kvstore.retry_s", "positive, finite number", "inf")),
        ({"kvstore.disk_size": "-1GiB"}, ("kvstore.disk_size", "-1GiB")),
        ({"kvstore.gpu_size": None}, ("kvstore.gpu_size", "None")),
        ({"kvstore.url": "tcp://127.0.0.1:99999"}, ("kvstore.url", "a port is a number in 1-65535")),
        ({"kvstore.url": "127.0.0.1:5555"}, ("kvstore.url", "must look like tcp://127.0.0.1:5555")),
        ({"kvstore.chunk_size": True}, ("kvstore.chunk_size", "positive integer")),
        ({"kvstore.chunk_size": 16.0}, ("kvstore.chunk_size", "positive integer", "16.0")),
        ({"kvstore.chunk_size": -16}, ("kvstore.chunk_size", "positive integer", "-16")),
        ({"kvstore.chunk_size": "16"}, ("kvstore.chunk_size", "positive integer")),
        ({"kvstore.async_disk_loads": "false"}, ("kvstore.async_disk_loads", "true or false", "'false'")),
        ({"kvstore.async_disk_loads": 0}, ("kvstore.async_disk_loads", "true or false")),
        ({"kvstore.url": ""}, ("kvstore.url", "non-empty string")),
        ({"kvstore.url": 5555}, ("kvstore.url", "non-empty string", "5555")),
        ({"kvstore.url": "127.0.0.1:5555"}, ("kvstore.url", "tcp://127.0.0.1:5555")),
        ({"kvstore.model_id": ""}, ("kvstore.model_id", "non-empty string")),
        ({"kvstore.tiers": ["cpu", "disk"]}, ("kvstore.tiers", "non-empty string")),
        ({"kvstore.data_dir": ""}, ("kvstore.data_dir", "path string")),
        ({"kvstore.config": 3}, ("kvstore.config", "path string")),
    ],
)
def test_bad_keys_and_values_are_one_line_errors_naming_the_key(
    extra_config: dict[str, object], fragments: tuple[str, ...]
) -> None:
    one_line_error(extra_config, *fragments)


@pytest.mark.parametrize("name", sorted(EMBEDDED_VALUES))
def test_an_embedded_key_next_to_a_url_is_refused(name: str) -> None:
    one_line_error(
        {"kvstore.url": "tcp://127.0.0.1:5555", f"kvstore.{name}": EMBEDDED_VALUES[name]},
        f"kvstore.{name}",
        "kvstore.url",
    )


def test_every_embedded_key_next_to_a_url_is_named_at_once() -> None:
    message = one_line_error(
        {"kvstore.url": "tcp://127.0.0.1:5555"} | {f"kvstore.{name}": value for name, value in EMBEDDED_VALUES.items()}
    )
    assert all(f"kvstore.{name}" in message for name in EMBEDDED_VALUES), message


# -- properties ----------------------------------------------------------------------------------------------------

positive_numbers = st.one_of(
    st.integers(min_value=1, max_value=10**6),
    st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False),
)
sizes = st.one_of(
    st.integers(min_value=1, max_value=2**50),
    st.builds("{}{}".format, st.integers(1, 4096), st.sampled_from(["GiB", "MiB", "GB", "k", ""])),
)
names = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=16)
paths = names.map(lambda text: f"/data/{text}")
top_values = st.fixed_dictionaries(
    {},
    optional={
        "model_id": names,
        "lookup_timeout_s": positive_numbers,
        "transfer_timeout_s": positive_numbers,
        "retry_s": positive_numbers,
        "async_disk_loads": st.booleans(),
    },
)
embedded_values = st.fixed_dictionaries(
    {},
    optional={
        "data_dir": paths,
        "tiers": names,
        "cpu_size": sizes,
        "gpu_size": sizes,
        "disk_size": sizes,
        "chunk_size": st.integers(min_value=1, max_value=4096),
        "config": paths,
    },
)


def converted(name: str, value: object) -> object:
    if name in ("data_dir", "config"):
        return Path(str(value))
    if name in ("cpu_size", "gpu_size", "disk_size"):
        return str(value)
    if name.endswith("_s"):
        return float(value)  # type: ignore[arg-type]
    return value


@hypothesis_settings(deadline=None)  # pure and fast, but the machine may be busy
@given(top=top_values, embedded=embedded_values, url=st.none() | st.integers(1, 65535).map("tcp://h:{}".format))
def test_any_valid_combination_round_trips_into_the_dataclasses(
    top: dict[str, object], embedded: dict[str, object], url: str | None
) -> None:
    extra_config = {f"kvstore.{name}": value for name, value in top.items()}
    if url is not None:
        extra_config["kvstore.url"] = url
    else:
        extra_config |= {f"kvstore.{name}": value for name, value in embedded.items()}
    settings = parse_connector_settings(extra_config)
    assert settings.url == url
    for name, value in top.items():
        assert getattr(settings, name) == converted(name, value), name
    expected_embedded = {} if url is not None else {name: converted(name, value) for name, value in embedded.items()}
    assert settings.embedded == EmbeddedServerSettings(**expected_embedded)  # type: ignore[arg-type]
    flags = settle_data_dir(settings, preset_layout("smollm2-135m")).embedded.serve_flags()
    assert flags[:2] == [
        "--data-dir",
        str(settings.embedded.data_dir or default_engine_data_dir(preset_layout("smollm2-135m"))),
    ]
    assert len(flags) == 2 * (1 + len([name for name in expected_embedded if name != "data_dir"]))


SETTING_NAMES = frozenset(
    {field.name for field in dataclasses.fields(ConnectorSettings) if field.name != "embedded"}
    | {field.name for field in dataclasses.fields(EmbeddedServerSettings) if field.name != "enable_blend"}
)
"""Every ``kvstore.<name>`` the connector takes, from its settings' fields (``KNOWN_NAMES`` lists only some:
hypothesis drew ``kvstore.blend`` as "unknown" from the strings it tries)."""


def is_unknown(key: str) -> bool:
    return not key.startswith("kvstore.") or key.removeprefix("kvstore.") not in SETTING_NAMES


@hypothesis_settings(deadline=None)  # pure and fast, but the machine may be busy
@given(
    valid=embedded_values,
    junk_key=st.one_of(st.text(max_size=24), st.text(max_size=24).map("kvstore.{}".format)).filter(is_unknown),
    junk_value=st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(), st.lists(st.integers())),
)
def test_any_unknown_key_is_refused_whatever_comes_with_it(
    valid: dict[str, object], junk_key: str, junk_value: object
) -> None:
    extra_config = {f"kvstore.{name}": value for name, value in valid.items()} | {junk_key: junk_value}
    with pytest.raises(ConfigError, match="unknown kvstore connector setting") as raised:
        parse_connector_settings(extra_config)
    assert repr(junk_key) in str(raised.value)


@hypothesis_settings(deadline=None)  # pure and fast, but the machine may be busy
@given(
    name=st.sampled_from([name for name in KNOWN_NAMES if name.endswith(("_gb", "_s"))]),
    value=st.one_of(
        st.booleans(),
        st.text(),
        st.none(),
        st.integers(max_value=0),
        st.floats(max_value=0.0),
        st.just(float("nan")),
    ),
)
def test_a_number_setting_refuses_anything_but_a_positive_number(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"kvstore.{name} must be a positive, finite number"):
        parse_connector_settings({f"kvstore.{name}": value})
