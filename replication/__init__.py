"""delaymq.replication: one log-shipping mechanism for every replicated server (docs/architecture.md, "Replication and fencing").

- ``wire``: FETCH's request and answer.
- ``epochs``: ``EpochHistory``, where each epoch's writes begin (where two logs part).
- ``source``: ``ReplicationSource``, the master's side: serves FETCH, tracks each
  slave's durable offset, in-sync slaves, the high watermark, a side journal.
- ``fetcher``: ``ReplicaFetcher``, the slave's side: fetches, appends the same bytes
  at the same offsets, reports what it made durable.
- ``roles``: the role loop, ``Role`` (what a member reports it is), ``Handover``, ``Mastership``.
- ``shell``: ``ReplicatedServer``, what every replicated server shares around its
  sessions (FETCH, role and epoch, registration, the crash scope, the drains of a role change).
- ``statistics``: ``ReplicationStatistics``, the replication state STATUS and the metrics report.

Docs: docs/replication.md.
"""
