"""The ``kvstore`` command line: inspect, evict, bench, demo."""

__all__: list[str] = []
