"""``kvstore serve`` as a process: start-up checks (one line, non-zero exit, before anything starts), the
handshake, graceful SIGTERM/SIGINT, the data dir's ownership."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import msgpack
import pytest

from kvstore.cli.main import main
from kvstore.cli.serve import startup_lines
from kvstore.config import GIB
from kvstore.errors import ConfigError, LayoutMismatchError
from kvstore.presets import preset_layout
from kvstore.server.app import ServerAddress
from kvstore.server.host_facts import HostFacts
from kvstore.server.settings import ServeFlags, load_config_file, resolve_settings
from kvstore.tiers.base import TierName
from kvstore.version import __version__
from kvstore.wire.connection import Connection
from kvstore.wire.protocol import PROTOCOL_VERSION, Op, decode_reply
from tests.server.conftest import CHUNK_SIZE, REPO_ROOT, SERVER_LAYOUT, ServerProcess, running_server, serve_args

MACHINE = HostFacts(cuda_available=False, available_memory_bytes=16 * GIB, gpu_free_bytes=0)


def health_status(server: ServerProcess) -> str:
    """The ``status`` of a health request over a raw connection (no hello needed)."""
    connection = Connection(server.url)
    try:
        reply = connection.request(Op.HEALTH, None, {}, None, 10.0)
    finally:
        connection.close()
    assert reply.ok and reply.result is not None, reply.error_message
    return reply.result.required_str("status", 32)


def run_serve(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        serve_args(tmp_path / "data", None, *extra), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )


def one_line_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 1, result.stderr
    assert len(lines) == 1 and lines[0].startswith("kvstore: error:") and fragment in lines[0], result.stderr
    assert "listening" not in result.stdout


# -- settings, in-process ------------------------------------------------------------------------------------------


def test_defaults_serve_out_of_the_box(tmp_path: Path) -> None:
    settings = resolve_settings(ServeFlags(data_dir=tmp_path / "d"), MACHINE)
    store = settings.store
    assert store.tiers == (TierName.CPU, TierName.DISK) and store.chunk_size == 256
    assert store.cpu_capacity_bytes == 4 * GIB and settings.layout is None
    assert (settings.loop.host, settings.loop.port, settings.metrics_port) == ("127.0.0.1", 5555, 5556)
    with_cuda = HostFacts(cuda_available=True, available_memory_bytes=16 * GIB, gpu_free_bytes=80 * GIB)
    assert resolve_settings(ServeFlags(data_dir=tmp_path / "d"), with_cuda).store.tiers[0] is TierName.GPU
    small = HostFacts(cuda_available=False, available_memory_bytes=2 * GIB, gpu_free_bytes=0)
    assert resolve_settings(ServeFlags(data_dir=tmp_path / "d"), small).store.cpu_capacity_bytes == GIB // 2


def test_the_start_up_lines_name_every_tier_its_size_and_whether_it_is_a_default(tmp_path: Path) -> None:
    flags = ServeFlags(data_dir=tmp_path / "d", cpu_size="512MiB")
    settings = resolve_settings(flags, MACHINE, environ={})
    address = ServerAddress(url="tcp://127.0.0.1:1", metrics_url="http://127.0.0.1:2/metrics", disk_chunks=42)
    lines = startup_lines(settings, address)
    assert lines[0] == f"kvstore {__version__} listening on tcp://127.0.0.1:1 (metrics http://127.0.0.1:2/metrics)"
    assert lines[1] == "layout set by the first client; chunks of 256 tokens"
    assert lines[2] == "cpu tier: 512.00 MiB of RAM (set by --cpu-size)", "sizes as inspect writes them"
    assert lines[3].startswith("disk tier: ") and "the default: 64GiB, at most half the free disk" in lines[3]
    from_env = resolve_settings(ServeFlags(data_dir=tmp_path / "d"), MACHINE, environ={"KVSTORE_CPU_SIZE": "1GiB"})
    assert startup_lines(from_env, address)[2] == "cpu tier: 1.00 GiB of RAM (set by KVSTORE_CPU_SIZE)"
    assert lines[4] == f"data dir {(tmp_path / 'd').absolute()}: 42 chunks recovered from disk"
    assert lines[5] == 'connect: kvstore.Client("tcp://127.0.0.1:1"); look: kvstore inspect --url tcp://127.0.0.1:1'
    one = ServerAddress(url="tcp://127.0.0.1:1", metrics_url="http://127.0.0.1:2/metrics", disk_chunks=1)
    assert startup_lines(settings, one)[4].endswith(": 1 chunk recovered from disk")


def test_the_start_up_lines_say_where_kv_events_go(tmp_path: Path) -> None:
    address = ServerAddress(url="tcp://127.0.0.1:1", metrics_url="http://127.0.0.1:2/metrics", disk_chunks=0)
    flags = ServeFlags(data_dir=tmp_path / "d", kv_events="tcp://*:5557", kv_events_replay="tcp://*:5558")
    lines = startup_lines(resolve_settings(flags, MACHINE, environ={}), address)
    assert lines[-2] == (
        "kv events: published on tcp://*:5557 every 50 ms, replay and snapshots on tcp://*:5558 (docs/routing.md)"
    )
    alone_flags = ServeFlags(data_dir=tmp_path / "d", kv_events="tcp://*:5557", kv_events_interval_ms=20)
    alone = resolve_settings(alone_flags, MACHINE, environ={})
    expected = "kv events: published on tcp://*:5557 every 20 ms, no replay (docs/routing.md)"
    assert startup_lines(alone, address)[-2] == expected
    without = resolve_settings(ServeFlags(data_dir=tmp_path / "d"), MACHINE, environ={})
    assert not any(line.startswith("kv events") for line in startup_lines(without, address))


def test_flags_override_the_environment_which_overrides_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(
        'tiers = ["cpu"]\ncpu_size = "1.5GiB"\nport = 6000\nmetrics_port = 6001\nenable_blend = true\n'
        'layout = "llama3.1-8b"\nworkers = 3\n'
    )
    environ = {"KVSTORE_PORT": "6500", "KVSTORE_WORKERS": "5", "KVSTORE_ENABLE_BLEND": "no", "HOME": "/root"}
    settings = resolve_settings(ServeFlags(port=7000, data_dir=tmp_path / "d"), MACHINE, config, environ)
    assert settings.store.tiers == (TierName.CPU,) and settings.store.cpu_capacity_bytes == int(1.5 * GIB)
    assert settings.loop.port == 7000, "the flag wins"
    assert settings.loop.num_control_workers == 5 and not settings.store.enable_blend, "the environment beats the file"
    assert settings.metrics_port == 6001 and settings.layout == preset_layout("llama3.1-8b"), "the file beats defaults"
    assert settings.given_by["port"] == "--port" and settings.given_by["workers"] == "KVSTORE_WORKERS"
    assert settings.given_by["cpu_size"] == f"{config} cpu_size" and "chunk_size" not in settings.given_by


def test_every_setting_has_a_flag_a_config_key_and_a_variable(tmp_path: Path) -> None:
    """The three spellings come from ServeFlags' fields: a new setting cannot miss one."""
    import dataclasses

    from kvstore.cli.serve import serve_command
    from kvstore.server.settings import env_name, flag_name

    options = {option for parameter in inspect_parameters(serve_command) for option in parameter}
    for setting in dataclasses.fields(ServeFlags):
        flag = flag_name(setting.name)
        assert flag in options or f"--enable-{setting.name.removeprefix('enable_')}" in options, flag
        assert env_name(setting.name) == "KVSTORE_" + setting.name.upper()


def inspect_parameters(callback: object) -> list[list[str]]:
    """The option names of each parameter of a typer command."""
    import inspect

    names = []
    for parameter in inspect.signature(callback).parameters.values():  # type: ignore[arg-type]
        default = parameter.default
        declared = [d for d in (getattr(default, "param_decls", None) or []) for d in d.split("/")]
        names.append([name for name in declared if name.startswith("--")])
    return names


@pytest.mark.parametrize(
    ("environ", "fragment"),
    [
        ({"KVSTORE_PORT": "many"}, "KVSTORE_PORT=many must be an integer"),
        ({"KVSTORE_ENABLE_BLEND": "maybe"}, "KVSTORE_ENABLE_BLEND=maybe must be one of"),
        ({"KVSTORE_CPU_SIZE_GB": "4"}, "unknown variable KVSTORE_CPU_SIZE_GB"),
        ({"KVSTORE_CPU_SIZE": "lots"}, "--cpu-size: size 'lots' is not a size"),
    ],
)
def test_bad_environment_variables_are_one_line_errors(tmp_path: Path, environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as caught:
        resolve_settings(ServeFlags(data_dir=tmp_path / "d"), MACHINE, environ=environ)
    assert "\n" not in str(caught.value)


def test_variables_that_are_not_server_settings_are_left_alone(tmp_path: Path) -> None:
    environ = {"KVSTORE_CACHE_DIR": "/tmp/models", "KVSTORE_CONNECTOR_TRACE": "/tmp/trace.jsonl",
               "KVSTORE_VALKEY_SERVER": "/opt/valkey-server"}  # fmt: skip
    assert resolve_settings(ServeFlags(data_dir=tmp_path / "d"), MACHINE, environ=environ).loop.port == 5555


def test_the_remote_password_comes_from_the_environment_only(tmp_path: Path) -> None:
    flags = ServeFlags(data_dir=tmp_path / "d", tiers="cpu,disk,remote", remote_url="valkey://cache:6379")
    settings = resolve_settings(flags, MACHINE, environ={"KVSTORE_REMOTE_PASSWORD": "s3cret"})
    assert settings.store.remote_password == "s3cret" and "s3cret" not in repr(settings)
    assert settings.store.remote_url == "valkey://cache:6379" and settings.store.remote_write == "through"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("cpu_size_gb = 1\n", "unknown key 'cpu_size_gb'"),
        ("port = '5555'\n", "must be int"),
        ("cpu_size = 1.5\n", "must be a size string"),
        ("tiers = [1]\n", "list of strings"),
        ("this is not toml", "is not TOML"),
    ],
)
def test_bad_config_files_are_one_line_errors(tmp_path: Path, text: str, fragment: str) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(text)
    with pytest.raises(ConfigError, match=fragment):
        load_config_file(config)


@pytest.mark.parametrize(
    ("flags", "error", "fragment"),
    [
        (ServeFlags(tiers="gpu,cpu"), ConfigError, "no CUDA"),
        (ServeFlags(tiers="disk,cpu"), ConfigError, "out of order"),
        (ServeFlags(tiers=""), ConfigError, "no tiers"),
        (ServeFlags(cpu_size="64GiB"), ConfigError, "--cpu-size 64.00GiB does not fit"),
        (ServeFlags(disk_size="1000000GiB"), ConfigError, "--disk-size"),
        (ServeFlags(cpu_size="-1GiB"), ConfigError, "--cpu-size: size '-1GiB' is not a size"),
        (ServeFlags(port=70000), ConfigError, "not a TCP port"),
        (ServeFlags(workers=0), ConfigError, "between 1 and 64"),
        (ServeFlags(enable_dedup_content=True), ConfigError, "needs enable_blend"),
        (ServeFlags(layout="gpt-17"), ConfigError, "neither a preset"),
        (ServeFlags(tiers="cpu,disk", cpu_size="0"), ConfigError, "leaves the cpu tier no room for a chunk of any"),
        (ServeFlags(tiers="cpu,disk", cpu_size="2"), ConfigError, "256 tokens take 2.81 MiB"),  # issue 45: the floor
        (ServeFlags(tiers="cpu", cpu_size="1023", chunk_size=256), ConfigError, "no room for a chunk of any model"),
        (ServeFlags(tiers="cpu", cpu_size="1KiB", layout="llama3.1-8b"), ConfigError, "no room for one chunk"),
    ],
)
def test_invalid_settings_fail_before_start_up(
    tmp_path: Path, flags: ServeFlags, error: type[Exception], fragment: str
) -> None:
    flags = ServeFlags(**{name: getattr(flags, name) for name in ServeFlags.__slots__} | {"data_dir": tmp_path})
    with pytest.raises(error, match=fragment):
        resolve_settings(flags, MACHINE, environ={})


def test_the_data_dir_decides_chunk_size_and_layout(tmp_path: Path) -> None:
    from kvstore import StoreConfig, TieredStore

    data = tmp_path / "data"
    config = StoreConfig(tiers=(TierName.DISK,), chunk_size=CHUNK_SIZE, data_dir=data, disk_capacity_bytes=1 << 26)
    TieredStore(SERVER_LAYOUT, config).close()
    settings = resolve_settings(ServeFlags(data_dir=data), MACHINE)
    assert settings.store.chunk_size == CHUNK_SIZE and settings.layout == SERVER_LAYOUT
    with pytest.raises(LayoutMismatchError, match="--chunk-size 256 disagrees"):
        resolve_settings(ServeFlags(data_dir=data, chunk_size=256), MACHINE)
    with pytest.raises(LayoutMismatchError, match="use another --data-dir"):
        resolve_settings(ServeFlags(data_dir=data, layout="smollm2-135m"), MACHINE)


# -- the process ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "code", "fragment"),
    [
        (["--tiers", "gpu,cpu"], 1, "no CUDA"),
        (["--cpu-size", "100000GiB"], 1, "does not fit"),
        (["--port", "many"], 2, "--port"),
        (["--config", "/nonexistent.toml"], 1, "cannot read --config"),
    ],
)
def test_bad_flags_exit_with_one_line_before_start_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], code: int, fragment: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--data-dir", str(tmp_path / "data"), *argv])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert exited.value.code == code and len(lines) == 1 and fragment in lines[0], captured.err
    assert "listening" not in captured.out and not (tmp_path / "data").exists()


@pytest.mark.parametrize("where", ["a_regular_file", "under_proc"])
def test_a_data_dir_that_cannot_be_one_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    if where == "a_regular_file":
        data_dir, fragment = tmp_path / "file", "is not a directory"
        data_dir.write_text("not a data dir")
    else:
        data_dir, fragment = Path("/proc/kv"), "cannot create data dir /proc/kv"
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--data-dir", str(data_dir), "--tiers", "cpu,disk", "--layout", "smollm2-135m"])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert exited.value.code == 1 and len(lines) == 1 and fragment in lines[0], captured.err
    assert "internal error" not in captured.err


def test_sigint_finishes_flushes_and_exits_0(tmp_path: Path) -> None:
    with running_server(tmp_path / "data") as server:
        assert health_status(server) == "serving"
        assert json.loads((server.data_dir / "serve.json").read_text())["url"] == server.url
        code = server.stop(signal.SIGINT)
        assert server.process.stdout is not None
        rest = server.process.stdout.read()
    assert code == 0 and "stopped" in rest, server.stderr()
    assert "Traceback" not in server.stderr()
    assert not (server.data_dir / "serve.json").exists()


def test_the_socket_answers_malformed_requests_and_a_second_server_is_refused(tmp_path: Path) -> None:
    import zmq

    with running_server(tmp_path / "data") as server:
        one_line_error(run_serve(tmp_path), f"held by kvstore serve (pid {server.pid}) at {server.url}")
        context = zmq.Context()
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(server.url)
        try:
            socket.send_multipart([b"\xc1garbage"])
            socket.send_multipart([msgpack.packb({"v": PROTOCOL_VERSION, "id": 4, "op": "fly", "args": {}})])
            socket.send_multipart([msgpack.packb({"v": 9, "id": 5, "op": "health", "args": {}})])
            stats = {"v": PROTOCOL_VERSION, "id": 6, "op": "stats", "client": None, "args": {}}
            socket.send_multipart([msgpack.packb(stats)])
            replies = []
            for _ in range(4):
                assert socket.poll(10_000), "the server stopped answering"
                replies.append(decode_reply([frame.buffer for frame in socket.recv_multipart(copy=False)]))
        finally:
            socket.close()
            context.term()
        codes = {reply.request_id: reply.error_code for reply in replies}
        assert codes == {None: "malformed", 4: "unknown_op", 5: "unsupported_version", 6: "not_registered"}
        assert health_status(server) == "serving"
        metrics_base = server.metrics_url.removesuffix("/metrics")
        with urllib.request.urlopen(f"{metrics_base}/healthz", timeout=10) as response:
            assert response.status == 200 and json.loads(response.read())["status"] == "serving"
        with pytest.raises(urllib.error.HTTPError) as not_found:
            urllib.request.urlopen(f"{metrics_base}/nothing", timeout=10)
        not_found.value.close()
        with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
            text = response.read().decode()
        assert 'kvstore_requests_total{op="-",outcome="malformed"} 1.0' in text
        assert 'kvstore_requests_total{op="stats",outcome="not_registered"} 1.0' in text
        assert 'kvstore_tier_capacity_bytes{tier="cpu"}' in text


def test_the_first_client_sets_the_layout_of_a_fresh_server(tmp_path: Path) -> None:
    from kvstore import Client, KVLayout

    data = tmp_path / "data"
    with running_server(data, layout=None) as server:
        with Client(server.url) as admin:
            assert admin.info().layout is None and not admin.health().layout_registered
            with pytest.raises(ConfigError, match="no layout is registered"):
                admin.flush()
        with Client(server.url, SERVER_LAYOUT) as first:
            assert first.server.layout == SERVER_LAYOUT
        with pytest.raises(LayoutMismatchError, match="start another server"):
            Client(server.url, KVLayout(model_id="second", num_layers=2, num_kv_heads=2, head_dim=16))
        assert server.stop() == 0
    assert resolve_settings(ServeFlags(data_dir=data), MACHINE).layout == SERVER_LAYOUT, "the data dir recorded it"


def test_serve_help_has_examples_and_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert exited.value.code == 0 and "Examples" in out and "kvstore serve --config" in out
    assert "(default:" in out and "[default:" not in out
