"""What a data dir says about who owns it, readable by any process without opening the store.

- ``owner_lock``: the one-writer lock, an flock on the directory itself (``LOCK`` is only a pid note);
- ``server_record``: ``serve.json``, where the running server that holds the data dir can be reached.

The disk tier takes the lock; the server writes the record; offline tools and the vLLM connector read both.
"""

__all__: list[str] = []
