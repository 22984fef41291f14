"""``TensorParallelRanks`` over a real two-process gloo group: what the ranks of a blend pass agree on, and that a
failure on one rank stops the pass on both at the same point (no rank left waiting in a sum).

The group stands in for vLLM's ``GroupCoordinator`` only in name: it is a real ``torch.distributed`` gloo group of
two processes, which is what vLLM's tensor-parallel CPU group is.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed
import torch.multiprocessing

from kvstore.blend.layerwise import _on_every_rank
from kvstore.blend.vllm.tensor_parallel import TensorParallelRanks
from kvstore.errors import KVStoreError

pytestmark = pytest.mark.timeout(120)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        group = SimpleNamespace(cpu_group=torch.distributed.group.WORLD, ranks=[0, 1], rank_in_group=rank, world_size=2)
        ranks = TensorParallelRanks(group)
        seen: dict[str, object] = {"lead": ranks.is_lead, "size": ranks.size}
        seen["shared"] = ranks.lead_value(lambda: {"plan": rank})  # only the lead's make runs
        try:
            ranks.lead_value(lambda: _fail("the store is down"))
        except Exception as exc:
            seen["lead_failure"] = f"{type(exc).__name__}: {exc}"
        seen["all_true_both"] = ranks.all_true(True)
        seen["all_true_one"] = ranks.all_true(rank == 0)
        seen["equal"] = ranks.all_equal(12345)
        seen["unequal"] = ranks.all_equal(12345 + rank)
        scores = torch.tensor([0.1, 0.2, 0.3], dtype=torch.float32) * (rank + 1) + rank * 1e-7
        seen["summed"] = ranks.summed(scores).tolist()
        undone: list[int] = []
        try:
            _on_every_rank(
                ranks, lambda: _fail("a layer's load failed") if rank == 1 else 7, undo=lambda: undone.append(1)
            )
        except KVStoreError as exc:
            seen["step_failure"] = str(exc)
        seen["undone"] = len(undone)
        seen["step_ok"] = _on_every_rank(ranks, lambda: rank, undo=lambda: undone.append(1))
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(seen))
    finally:
        torch.distributed.destroy_process_group()


def _fail(message: str) -> int:
    raise KVStoreError(message)


def test_two_ranks_agree_on_the_plan_the_votes_and_the_summed_scores_and_fail_together(tmp_path: Path) -> None:
    torch.multiprocessing.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    lead, other = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1))
    assert (lead["lead"], other["lead"], lead["size"]) == (True, False, 2)
    assert lead["shared"] == other["shared"] == {"plan": 0}
    assert lead["lead_failure"] == "KVStoreError: the store is down"  # the lead raises its own error
    assert "the lead rank's part of the blend pass failed: KVStoreError: the store is down" in other["lead_failure"]
    assert lead["all_true_both"] and other["all_true_both"]
    assert not lead["all_true_one"] and not other["all_true_one"]
    assert lead["equal"] and other["equal"] and not lead["unequal"] and not other["unequal"]
    assert lead["summed"] == other["summed"]  # the same bits on both ranks
    assert lead["summed"] == pytest.approx([0.3, 0.6, 0.9])
    assert other["step_failure"] == "a layer's load failed"  # the rank that failed raises its own error
    assert "another rank of the blend pass failed" in lead["step_failure"]
    assert lead["undone"] == other["undone"] == 1
    assert (lead["step_ok"], other["step_ok"]) == (0, 1)
