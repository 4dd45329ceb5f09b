"""delaymq.replication: one log-shipping mechanism for every replicated server (DESIGN.md section 2, item 7).

- ``wire``: FETCH's request and answer.
- ``epochs``: ``EpochHistory``, where each epoch's writes begin (where two logs part).
- ``source``: ``ReplicationSource``, the master's side: serves FETCH, tracks each
  slave's durable offset, in-sync slaves, the high watermark, a side journal.
- ``fetcher``: ``ReplicaFetcher``, the slave's side: fetches, appends the same bytes
  at the same offsets, reports what it made durable.

Docs: docs/replication.md.
"""
