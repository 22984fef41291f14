"""The retrieval workload, shared by the content-index and fleet-directory benchmarks.

Documents of 3,000 random tokens (12 chunks of 256, the last of 184) with random 16-byte keys per chunk; prompts of a
30-token system prompt, 5 of the documents in random order joined by 4-token separators, and a 20-token question
(15,066 tokens). Random draws in a fixed order, so a seed gives the same workload in both benchmarks. The sizes
are ``kvstore.bench.rag_shape``'s (torch-free, for the options' checks), re-exported here.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvstore.bench.rag_shape import CHUNK_TOKENS, CHUNKS_PER_DOCUMENT, DOCUMENT_TOKENS, DOCUMENTS_PER_QUERY, VOCAB
from kvstore.keys import PrefixKey

__all__ = [
    "CHUNKS_PER_DOCUMENT",
    "CHUNK_TOKENS",
    "DOCUMENTS_PER_QUERY",
    "DOCUMENT_TOKENS",
    "VOCAB",
    "Placed",
    "document_keys",
    "make_documents",
    "make_queries",
]


Placed = list[tuple[int, int]]
"""Where each document of a prompt lies: ``(position in the prompt, document index)``."""


def make_documents(rng: np.random.Generator, num_chunks: int) -> tuple[npt.NDArray[np.uint32], bytes]:
    """About ``num_chunks`` chunks' worth of documents (at least a prompt's worth), and their chunks' keys as one
    byte string (``document_keys`` cuts it)."""
    num_documents = max(DOCUMENTS_PER_QUERY, num_chunks // CHUNKS_PER_DOCUMENT)
    documents = rng.integers(0, VOCAB, size=(num_documents, DOCUMENT_TOKENS)).astype(np.uint32)
    return documents, rng.bytes(16 * num_documents * CHUNKS_PER_DOCUMENT)


def document_keys(raw_keys: bytes, document: int) -> list[PrefixKey]:
    """The chunk keys of one document."""
    first = 16 * document * CHUNKS_PER_DOCUMENT
    return [PrefixKey(raw_keys[first + 16 * c : first + 16 * (c + 1)]) for c in range(CHUNKS_PER_DOCUMENT)]


def make_queries(
    rng: np.random.Generator, documents: npt.NDArray[np.uint32], count: int
) -> list[tuple[npt.NDArray[np.uint32], Placed]]:
    """``count`` prompts and where their documents lie."""
    queries = []
    for _ in range(count):
        chosen = rng.choice(documents.shape[0], size=DOCUMENTS_PER_QUERY, replace=False).tolist()
        parts, placed, position = [rng.integers(0, VOCAB, 30).astype(np.uint32)], [], 30
        for document in chosen:
            placed.append((position, document))
            parts += [documents[document], rng.integers(0, VOCAB, 4).astype(np.uint32)]
            position += DOCUMENT_TOKENS + 4
        parts[-1] = rng.integers(0, VOCAB, 20).astype(np.uint32)
        queries.append((np.concatenate(parts), placed))
    return queries
