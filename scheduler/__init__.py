"""delaymq.scheduler: the delay server (docs/architecture.md, "The delay path"; docs/scheduler.md).

- ``server``: ``open_scheduler`` / ``Scheduler``: the member, in the replication shell
  (``delaymq.replication.shell``: roles, FETCH, registration, crash scope), over
  ``settings`` (``SchedulerSettings``), ``store``
  (``SchedulerStorage``: the data folder, cut-backs), ``current`` (the session now),
  ``schedule`` (SCHEDULE), ``changes`` (CANCEL, MOVE, QUERY), ``housekeeping``
  (cleanup, counters saved), ``status`` and ``counters`` (statistics, STATUS),
  ``delivery`` (SEND to realtime); ``roles``: the master and slave sessions.
- ``dispatcher``: ``Dispatcher``: loads hours and seconds (``dispatchloader``, over
  ``readahead``), fires due messages (``dispatchfirer``), sends them to realtime servers
  in a lane per subject (``dispatchlanes``), records them in the dispatch logs
  (``dispatchconfirmer``); ``dispatchcontext`` is what those tasks share.
- ``wheelset``: ``WheelSet``: the pure rules of what to open, load and fire next.
- ``schedulelog``: ``ScheduleStore``, the storage's one entry point, extending
  ``committedschedule`` (what readers see), over ``schedulefolder`` (the folder's format,
  opened), ``staging`` and ``replaystep`` (filing a replay step in memory),
  ``schedulefiles`` (the commit's writes), ``recovery`` (on open), ``hourlog`` (reading an
  hour), ``dispatchlog``, and the formats ``delayindex``, ``headstable``, ``hours``;
  ``replay`` drives the filing (docs/scheduler-storage.md).
- ``idindex`` (lmdb) and ``indexrecords`` (what it reads from the message log): the id and
  business-key index; ``cancels``: what a master keeps in memory for CANCEL, MOVE, QUERY.

Nothing is imported here, so the storage modules load without the server's imports.
"""
