"""Helpers shared by the test folders, imported as ``from ..support.<module> import name``.

- ``polling``: ``wait_until`` (async, on the running trio clock) and ``poll_until`` (the wall clock, for
  servers in other processes), for states the servers reach by themselves with no event to wait on.
- ``network``: ``open_memory_metaserver`` (a metaserver on a new ``MemoryNetwork``) and ``Partition``
  (a member's network with some addresses cut off).
- ``tasks``: ``start_in_nursery``, a server's context entered in a task of its own.
- ``tokens``: the secrets several folders share, ``token``/``tokens_toml`` to write tokens files, and the
  common tables (``SERVERS_TOKEN``, ``SHOP_TOKEN``, ``OPS_TOKEN``).
- ``cli``: ``delaymq(*args)`` in a child process, and ``wait_for_status`` polling ``delaymq status --json``.
"""
