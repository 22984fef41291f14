"""kvstore's version, from the installed distribution's metadata (one place: ``pyproject.toml``)."""

from __future__ import annotations

import importlib.metadata

__all__ = ["DISTRIBUTION", "__version__"]

DISTRIBUTION = "kvstore-llm"
"""The name kvstore is installed under (``pip install kvstore-llm``); ``kvstore`` on the package index is another
project's. The import name stays ``kvstore``."""

try:
    __version__ = importlib.metadata.version(DISTRIBUTION)
except importlib.metadata.PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "0+unknown"
