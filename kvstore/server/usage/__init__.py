"""Usage accounting of a server: what its lookups used, per chunk, per stored document and per plan
(``UsageLedger``, the one entry point; its docstring holds the vocabulary).

- ``ledger``: ``UsageLedger``, everything the server counts about what its lookups used;
- ``chunk_hits``: hits per chunk, a bounded counter of the plans that used each chunk;
- ``documents``: hits per stored document (the chunks one ``store()`` call added);
- ``documents_file``: ``DIR/document-hits.msgpack``, the document counts kept across restarts;
- ``plan_coverage``: how one lookup plan covers its prompt, for the lookup metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstore.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from kvstore.server.usage.ledger import UsageLedger
    from kvstore.server.usage.plan_coverage import PlanCoverage

__getattr__, __dir__ = lazy_exports(
    __name__,
    {"kvstore.server.usage.ledger": ("UsageLedger",), "kvstore.server.usage.plan_coverage": ("PlanCoverage",)},
)
__all__ = ["PlanCoverage", "UsageLedger"]
