"""Re-exports a package imports only when they are first read.

Why: a package ``__init__`` that imports its public names imports the whole package, and every import of one of
its modules runs that ``__init__`` first: ``import kvstore.client`` would load the store, LMDB, zstd, numba and
the server loop that way. A package lists its public names here instead (and imports them under
``TYPE_CHECKING`` for type checkers); an engine process then pays only for the modules it uses.

Usage, in a package's ``__init__.py``::

    if TYPE_CHECKING:
        from kvstore.content.index import FingerprintIndex, Match

    __getattr__, __dir__ = lazy_exports(__name__, {"kvstore.content.index": ("FingerprintIndex", "Match")})
    __all__ = ["FingerprintIndex", "Match"]
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, Sequence[str]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """A module ``__getattr__`` and ``__dir__`` for ``package`` that import ``exports`` (module -> names) on first use.

    A name read once is stored in the package's namespace, so later reads cost a dict lookup.
    """
    module_of = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> object:
        module = module_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(module_of))

    return __getattr__, __dir__
