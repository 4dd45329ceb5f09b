"""delaymq.scheduler: the delay server (DESIGN.md section 2; docs/scheduler.md).

- ``server``: ``open_scheduler`` / ``Scheduler``: SCHEDULE and STATUS, replay, cleanup.
- ``dispatcher``: ``Dispatcher``: loads hours and seconds, fires due messages, sends
  them to realtime servers, records them in the dispatch logs.
- ``wheelset``: ``WheelSet``: the pure rules of what to open, load and fire next.
- ``schedulelog``, ``delayindex``, ``dispatchlog``, ``replay``, ``hours``: the storage
  (docs/scheduler-storage.md).

Nothing is imported here, so the storage modules load without the server's imports.
"""
