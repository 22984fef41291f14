"""Every realistic CLI mistake is refused in one line on stderr with a non-zero exit, before torch, numba or LMDB are
imported (issue 45, item 9): a meta-path blocker in the child makes any such import fail the test, deterministically
(the times are measured by ``benchmarks/cli_refusal_times.py``, not here)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kvstore.cli.bench import bench_app
from kvstore.preset_names import PRESET_NAMES, SMALLEST_PRESET, SMALLEST_PRESET_ELEMENTS_PER_TOKEN
from tests.cli.cli_mistakes import Mistake, cli_mistakes, refusal_command
from tests.server.conftest import REPO_ROOT


def refused(mistake: Mistake, scratch: Path, *, block_heavy_imports: bool) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **mistake.env}
    return subprocess.run(
        refusal_command(mistake.argv, block_heavy_imports=block_heavy_imports),
        cwd=scratch, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def assert_one_line(result: subprocess.CompletedProcess[str], mistake: Mistake) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == mistake.exit_code, (mistake.name, result.stderr)
    assert len(lines) == 1 and mistake.fragment in lines[0], (mistake.name, result.stderr)
    assert "blocked by the test" not in result.stderr and "internal error" not in result.stderr, result.stderr
    assert result.stdout == "", (mistake.name, "nothing on stdout, not even a blank line", result.stdout)


def test_at_least_seventeen_mistakes_are_refused_in_one_line_without_torch_numba_or_lmdb(tmp_path: Path) -> None:
    mistakes = cli_mistakes(tmp_path)
    assert len(mistakes) >= 17 and len({m.name for m in mistakes}) == len(mistakes)
    assert {m.argv[0] for m in mistakes} == {"serve", "inspect", "evict", "demo", "bench"}
    for mistake in mistakes:
        assert_one_line(refused(mistake, tmp_path, block_heavy_imports=True), mistake)
    assert not (tmp_path / "data").exists() and not (tmp_path / "kvstore-data").exists(), "nothing was created"


def test_the_blocker_catches_a_command_that_imports_torch(tmp_path: Path) -> None:
    """The blocker is what makes the test above able to fail: a command that gets past its checks hits it."""
    demo = Mistake(name="demo runs", argv=("demo", "--data-dir", str(tmp_path / "demo")), fragment="")
    result = refused(demo, tmp_path, block_heavy_imports=True)
    assert result.returncode != 0 and "blocked by the test" in result.stderr


def test_every_benchmark_has_a_mistake(tmp_path: Path) -> None:
    """Each ``kvstore bench`` command (as its group lists them) is held to the one-line refusal above."""
    benchmarks = set(bench_app.info.cls.lazy_commands)  # type: ignore[union-attr]
    assert benchmarks == {m.argv[1] for m in cli_mistakes(tmp_path) if m.argv[0] == "bench"}


def test_the_light_preset_facts_match_the_presets() -> None:
    from kvstore.presets import PRESET_NAMES as LAYOUT_PRESETS
    from kvstore.presets import preset_layout

    assert PRESET_NAMES == LAYOUT_PRESETS
    per_token = {name: preset_layout(name).bytes_per_token // preset_layout(name).dtype.element_size_bytes
                 for name in PRESET_NAMES}  # fmt: skip
    assert per_token[SMALLEST_PRESET] == SMALLEST_PRESET_ELEMENTS_PER_TOKEN == min(per_token.values())


def test_the_top_bound_matches_what_a_server_answers() -> None:
    from kvstore.cli.inspect import MAX_TOP_DOCUMENTS
    from kvstore.wire.documents import MAX_TOP_DOCUMENTS as SERVER_MAX

    assert MAX_TOP_DOCUMENTS == SERVER_MAX
