"""The shape of the retrieval workload (``kvstore.bench.rag_workload``): chunk, document and prompt sizes.

Why apart: ``kvstore.bench.rebuild_options`` counts documents from them before ``kvstore bench rebuild`` imports
numpy, torch or LMDB; ``kvstore.bench.rag_workload`` re-exports them.
"""

from __future__ import annotations

__all__ = ["CHUNKS_PER_DOCUMENT", "CHUNK_TOKENS", "DOCUMENTS_PER_QUERY", "DOCUMENT_TOKENS", "VOCAB"]

CHUNK_TOKENS = 256
DOCUMENT_TOKENS = 3000
CHUNKS_PER_DOCUMENT = -(-DOCUMENT_TOKENS // CHUNK_TOKENS)
DOCUMENTS_PER_QUERY = 5
VOCAB = 128_000
