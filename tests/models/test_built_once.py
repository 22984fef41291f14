"""``built_once``: a cache directory made by one process while the others that ask wait for it, whole or not at all."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvstore.errors import StorageError
from kvstore.models import built_once as built_once_module
from kvstore.models.built_once import built_once

MAKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvstore.models.built_once import built_once

    target, log = Path(sys.argv[1]), Path(sys.argv[2])

    def build(directory: Path) -> None:
        with log.open("a") as made:
            made.write("built\\n")
        time.sleep(1.0)  # long enough for every other process to be waiting on the lock
        (directory / "config.json").write_text("{}")

    print(built_once(target, "config.json", build, "a test directory"))
""")


def test_processes_asking_at_once_build_it_once_and_all_get_it(tmp_path: Path) -> None:
    target, log = tmp_path / "cache" / "models" / "thing", tmp_path / "built.log"
    makers = [
        subprocess.Popen([sys.executable, "-c", MAKER, str(target), str(log)], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [maker.communicate(timeout=120)[0].strip() for maker in makers]
    assert [maker.returncode for maker in makers] == [0, 0, 0]
    assert outputs == [str(target)] * 3
    assert log.read_text() == "built\n"  # one build; the others waited and used it
    assert sorted(path.name for path in target.parent.iterdir()) == ["thing"]  # no partial directory left


def test_a_failed_build_leaves_nothing_and_the_next_call_builds_again(tmp_path: Path) -> None:
    target = tmp_path / "models" / "thing"

    def full_disk(directory: Path) -> None:
        (directory / "half").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(StorageError, match=r"cannot write a test directory to .*No space left.*free space"):
        built_once(target, "config.json", full_disk, "a test directory")
    assert list(target.parent.iterdir()) == []
    whole = built_once(target, "config.json", lambda made: (made / "config.json").write_text("{}"), "a test directory")
    assert whole == target
    assert (target / "config.json").read_text() == "{}"


def test_a_filesystem_without_locks_still_gets_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(built_once_module.fcntl, "flock", no_locks)
    target = tmp_path / "models" / "thing"
    assert built_once(target, "config.json", lambda made: (made / "config.json").write_text("{}"), "a thing") == target
    assert (target / "config.json").read_text() == "{}"
