"""A full consistency walk of a data dir: every chunk's meta, every frame it names, every frame on disk.

Where the disk tier's reads find a defect one chunk at a time (and drop it), ``check_data_dir`` finds all of them
at once, for an operator (``kvstore inspect --check``) and for tests after crashes and corruption:

- a meta record that fails its own checksum or format;
- a frame a meta names that is missing, or that fails its header, length or checksum checks (decoded in full);
- frames beyond a chunk's frame count;
- frames of no chunk: a write cut short by a crash (the next writable open removes them) or, beside a live
  writer, a write in flight. They are counted, not reported as problems.

Read-only: one read transaction per chunk (so no long-lived snapshot), never a write; memory grows with the
number of chunks (their keys), not their size. Runs in the caller's thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvstore.keys import KEY_BYTES
from kvstore.tiers.disk.environment import DiskEnvironment
from kvstore.tiers.disk.format import frame_key
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus
from kvstore.tiers.frames.meta import decode_meta

__all__ = ["DiskCheckReport", "check_data_dir"]

_MAX_PROBLEMS = 100
_FRAME_INDEX = slice(KEY_BYTES, KEY_BYTES + 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskCheckReport:
    """What a consistency walk found.

    Args:
        num_chunks: chunks with a readable meta record.
        num_frames: frames on disk.
        num_unfinished_frames: frames of no chunk (a cut-short or in-flight write; removed at a writable open).
        stored_bytes: the chunks' stored bytes as their metas record them.
        problems: one line per defect (at most 100; ``num_problems`` counts them all).
        num_problems: defects found.
    """

    num_chunks: int
    num_frames: int
    num_unfinished_frames: int
    stored_bytes: int
    problems: tuple[str, ...]
    num_problems: int

    @property
    def ok(self) -> bool:
        return self.num_problems == 0


def check_data_dir(
    env: DiskEnvironment, codec: FrameCodec, progress: Callable[[int], None] | None = None
) -> DiskCheckReport:
    """Walk every meta record and frame of ``env``; see the module docstring for what counts as a problem.

    Args:
        env: an open environment (read-only is enough).
        codec: the codec of the data dir's layout (element size), to decode frames.
        progress: called with the number of chunks checked so far, every 256 chunks.
    """
    problems: list[str] = []
    chunk_frames: dict[bytes, int] = {}
    stored_bytes = 0
    scratch = np.empty(0, dtype=np.uint8)
    with env.read() as txn:
        meta_keys = [bytes(key) for key in txn.cursor(db=env.meta_db).iternext(keys=True, values=False)]
    for checked, key in enumerate(meta_keys, start=1):
        with env.read() as txn:
            value = txn.get(key, db=env.meta_db)
            chunk = None if value is None else decode_meta(key, value)
            if value is None:
                continue  # deleted since the key pass (a live writer)
            if chunk is None:
                problems.append(f"chunk {key.hex()}: meta record unreadable (checksum or format)")
                continue
            chunk_frames[key] = chunk.num_frames
            stored_bytes += chunk.stored_bytes
            if scratch.shape[0] < chunk.frame_bytes:
                scratch = np.empty(chunk.frame_bytes, dtype=np.uint8)
            for index in range(chunk.num_frames):
                frame = txn.get(frame_key(chunk.key, index), db=env.payload_db)
                raw_bytes = min(chunk.frame_bytes, chunk.raw_bytes - index * chunk.frame_bytes)
                if frame is None:
                    problems.append(f"chunk {key.hex()}: frame {index} of {chunk.num_frames} is missing")
                    continue
                status = codec.decode_into(np.frombuffer(frame, dtype=np.uint8), scratch[:raw_bytes])
                if status is not FrameStatus.OK:
                    problems.append(f"chunk {key.hex()}: frame {index} is corrupt ({status.value})")
        if progress is not None and checked % 256 == 0:
            progress(checked)
    num_frames = num_unfinished = 0
    with env.read() as txn:
        for frame_name in txn.cursor(db=env.payload_db).iternext(keys=True, values=False):
            num_frames += 1
            owner = bytes(frame_name[:KEY_BYTES])
            if owner not in chunk_frames:
                num_unfinished += 1
            elif int.from_bytes(frame_name[_FRAME_INDEX], "big") >= chunk_frames[owner]:
                problems.append(f"chunk {owner.hex()}: stray frame {int.from_bytes(frame_name[_FRAME_INDEX], 'big')}")
    return DiskCheckReport(
        num_chunks=len(chunk_frames),
        num_frames=num_frames,
        num_unfinished_frames=num_unfinished,
        stored_bytes=stored_bytes,
        problems=tuple(problems[:_MAX_PROBLEMS]),
        num_problems=len(problems),
    )
