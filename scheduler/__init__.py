"""delaymq.scheduler: the delay server (DESIGN.md section 2; docs/scheduler.md).

- ``server``: ``open_scheduler`` / ``Scheduler``: SCHEDULE and STATUS, replay, cleanup.
- ``dispatcher``: ``Dispatcher``: loads hours and seconds, fires due messages, sends
  them to realtime servers, records them in the dispatch logs.
- ``wheelset``: ``WheelSet``: the pure rules of what to open, load and fire next.
- ``schedulelog``: ``ScheduleStore``, the storage's one entry point, over ``staging``
  (filing a replay step in memory), ``schedulefiles`` (the commit's writes),
  ``recovery`` (on open), ``hourlog`` (reading an hour), ``dispatchlog``, and the formats
  ``delayindex``, ``headstable``, ``hours``; ``replay`` drives the filing
  (docs/scheduler-storage.md).

Nothing is imported here, so the storage modules load without the server's imports.
"""
