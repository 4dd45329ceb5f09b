"""delaymq.realtime: the realtime server (message log, consume logs, pull logs, groups).

``open_realtime_server`` runs one server group; the sans-IO parts (``groups``,
``pulllog``, ``dedup.DedupWindow``, ``consumelog`` entry layout) are
importable on their own. On-disk formats: docs/realtime-storage.md.
"""

from delaymq.realtime.server import RealtimeServer, RealtimeStatistics, open_realtime_server

__all__ = ["RealtimeServer", "RealtimeStatistics", "open_realtime_server"]
