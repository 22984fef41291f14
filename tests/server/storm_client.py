"""A durable write storm against a server, for the kill -9 test: ``python -m tests.server.storm_client URL``.

Stores sequence after sequence (each fully determined by its seed: ``tests.integration.storm_writer.sequence``
shapes, this test's layout) with ``durable=True``, and prints ``durable N`` once the server acknowledged
sequences 0..N-1 as committed and synced. It runs until the server goes away (then exits 0) or it is killed.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kvstore import Client, ServerUnavailableError
from tests.server.conftest import SERVER_LAYOUT

TOKENS_PER_SEQUENCE = 80  # five 16-token chunks


def sequence(seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """Tokens and KV of sequence ``seed``; the first token is the seed, so a chunk names its sequence."""
    tokens = np.random.default_rng(seed).integers(0, 50_000, size=TOKENS_PER_SEQUENCE)
    tokens[0] = seed
    kv = torch.randn(SERVER_LAYOUT.chunk_shape(TOKENS_PER_SEQUENCE), generator=torch.Generator().manual_seed(seed))
    return tokens, kv.to(torch.bfloat16)


def main() -> None:
    with Client(sys.argv[1], SERVER_LAYOUT, timeout_s=2) as client:
        seed = 0
        try:
            while True:
                client.store(*sequence(seed), durable=True)
                seed += 1
                print(f"durable {seed}", flush=True)
        except ServerUnavailableError:
            return


if __name__ == "__main__":
    main()
