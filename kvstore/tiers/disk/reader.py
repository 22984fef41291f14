"""Reading a committed chunk: fetch its frames from LMDB and decode them on the codec pool into a buffer.

The calling thread fetches frame ``i + 1`` (``txn.get`` faults its pages in from disk) while codec helpers
decode frame ``i`` straight from the map into the destination, so a cold read overlaps I/O with decompression
and nothing proportional to the chunk is allocated. A frame whose checksum or format fails is reported, never
decoded into wrong bytes. A damaged LMDB page on the way to a frame (a flipped bit in a page number or a page
header: LMDB says page not found, corrupted or bad transaction) is reported the same way, as ``PageDamage``: the
chunk is a miss, the reader's call never an error (tests/integration/test_damaged_data_dir.py).

Threads: ``read_chunk`` runs on any caller thread; its read transaction stays open until every decode task of
the chunk has finished (the tasks read the transaction's map).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvstore.keys import PrefixKey
from kvstore.tiers.disk.environment import PAGE_DAMAGE, DiskEnvironment
from kvstore.tiers.disk.format import frame_key
from kvstore.tiers.frames.codec import FrameCodec, FrameStatus
from kvstore.tiers.frames.codec_pool import CodecPool, TaskBatch

__all__ = ["PageDamage", "read_chunk"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PageDamage:
    """A frame of the chunk lies behind a damaged LMDB page; ``reason`` is LMDB's words for it."""

    reason: str


def read_chunk(
    env: DiskEnvironment,
    codec: FrameCodec,
    pool: CodecPool,
    key: PrefixKey,
    frame_bytes: int,
    out_bytes: npt.NDArray[np.uint8],
) -> FrameStatus | PageDamage | None:
    """Decode every frame of a chunk into ``out_bytes`` (its exact raw size).

    Returns:
        ``FrameStatus.OK``, the first defect of a corrupt frame, ``PageDamage`` when LMDB cannot reach a frame
        through a damaged page, or ``None`` when the chunk is gone (deleted after the caller looked it up).
    """
    raw_bytes = out_bytes.shape[0]
    num_frames = -(-raw_bytes // frame_bytes)
    batch: TaskBatch[FrameStatus] = pool.batch()
    damage: PageDamage | None = None
    with env.read() as txn:
        try:
            for idx in range(num_frames):
                value = txn.get(frame_key(key, idx), db=env.payload_db)
                if value is None:
                    return None
                # A numpy view pins the value's address now: older py-lmdb re-points one memoryview per get.
                frame = np.frombuffer(value, dtype=np.uint8)
                target = out_bytes[idx * frame_bytes : min((idx + 1) * frame_bytes, raw_bytes)]
                batch.submit(functools.partial(codec.decode_into, frame, target))
        except PAGE_DAMAGE as exc:  # the transaction is unusable now: the frames decoded so far do not matter
            damage = PageDamage(reason=str(exc))
        finally:
            statuses = batch.wait()  # before the transaction ends
    if damage is not None:
        return damage
    return next((status for status in statuses if status is not FrameStatus.OK), FrameStatus.OK)
