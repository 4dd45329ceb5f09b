"""Small mutable state in lmdb: checkpoints, positions, indexes (docs/architecture.md, "Storage").

One ``StateStore`` is one lmdb environment in one data folder, with named
sub-databases. Writes are batched: a ``WriteBatch`` records puts and deletes and
applies them in one write transaction (one fsync) when its ``with`` block ends.
Because the batch is a list of operations, a full map is handled by aborting,
doubling the map size and replaying the batch, so ``MapFullError`` never reaches a
caller. A write the disk cannot take (full, or an I/O error) raises ``StoreIOError``
with the ``OSError`` behind it; nothing of the batch is written and the store
stays usable, so the same write succeeds once space is freed.
Every call blocks; trio code calls it through a ``run_blocking`` (``delaymq.storage.threads``).
"""

from __future__ import annotations

import errno
import os
import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from operator import itemgetter
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

import lmdb
import msgpack

from delaymq.storage.errors import StateStoreError, StoreClosed, StoreIOError
from delaymq.storage.folder import DataFolder
from delaymq.storage.format import FormatValue, ensure_format

STATE_FORMAT = "lmdb-state"
STATE_FORMAT_VERSION = 1
DEFAULT_MAP_SIZE = 64 << 20
DEFAULT_MAX_MAP_SIZE = 1 << 40
#: lmdb reports a commit cut short by a full disk as EIO: with less free than this, that is a full disk.
LOW_SPACE = 64 << 20

Bytes = bytes | bytearray | memoryview
_DELETE = object()


def pack(value: Any) -> bytes:
    """msgpack a value for storing (bytes stay bytes, strings stay strings)."""
    return msgpack.packb(value, use_bin_type=True)


def unpack(data: Bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


class _ResizeGate:
    """Many transactions at once, or one map resize alone.

    lmdb may only change the map size while this process has no transaction
    open, readers included.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._active = 0
        self._resizing = False

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._condition:
            while self._resizing:
                self._condition.wait()
            self._active += 1
        try:
            yield
        finally:
            with self._condition:
                self._active -= 1
                if not self._active:
                    self._condition.notify_all()

    @contextmanager
    def resize(self) -> Iterator[None]:
        with self._condition:
            while self._resizing:
                self._condition.wait()
            self._resizing = True
            while self._active:
                self._condition.wait()
        try:
            yield
        finally:
            with self._condition:
                self._resizing = False
                self._condition.notify_all()


class StateStore:
    """An lmdb environment with named sub-databases. Use ``StateStore.open``."""

    def __init__(self, folder: DataFolder, env: lmdb.Environment, *, max_map_size: int) -> None:
        self._folder = folder
        self._env = env
        self._max_map_size = max_map_size
        self._gate = _ResizeGate()
        self._dbs: dict[str, Any] = {}
        self._dbs_lock = threading.Lock()
        self._max_key = env.max_key_size()
        self._closed = False
        self._resizes = 0
        #: For the dbs named by ``keep_highest_key``: a key at or above every key stored (b"": none).
        self._highest: dict[str, bytes] = {}
        self._highest_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        directory: str | os.PathLike[str],
        *,
        map_size: int = DEFAULT_MAP_SIZE,
        max_map_size: int = DEFAULT_MAX_MAP_SIZE,
        max_dbs: int = 64,
        extra_format: Mapping[str, FormatValue] | None = None,
    ) -> StateStore:
        """Open (or create) the store in ``directory``.

        ``map_size`` is where the map starts; it doubles when full, up to
        ``max_map_size``. ``extra_format`` holds a caller's own on-disk parameters
        (say an entry layout version), kept in the folder's FORMAT file and
        compared on every open like the store's own.
        """
        if map_size <= 0 or max_map_size < map_size:
            raise ValueError(f"map_size must be positive and at most max_map_size {max_map_size}, got {map_size}")
        params: dict[str, FormatValue] = {"format": STATE_FORMAT, "version": STATE_FORMAT_VERSION}
        for name, value in (extra_format or {}).items():
            if name in params:
                raise ValueError(f"extra_format may not set the store's own parameter {name!r}")
            params[name] = value
        folder = DataFolder(directory, what="state store")
        try:
            has_data = (folder.path / "data.mdb").exists()
            ensure_format(folder.path, params, has_data=has_data)
            env = lmdb.open(
                str(folder.path),
                map_size=map_size,
                max_dbs=max_dbs,
                subdir=True,
                create=True,
                readahead=False,
            )
            # An existing map may be bigger than asked for; never shrink it.
            if env.info()["map_size"] < map_size:
                env.set_mapsize(map_size)
        except BaseException:
            folder.close()
            raise
        return cls(folder, env, max_map_size=max_map_size)

    @property
    def directory(self) -> Path:
        return self._folder.path

    @property
    def map_size(self) -> int:
        return int(self._env.info()["map_size"])

    @property
    def resizes(self) -> int:
        """How many times the map has grown since open."""
        return self._resizes

    # ------------------------------------------------------------- reading

    def get(self, db: str, key: Bytes) -> bytes | None:
        return self.get_many(db, [key])[0]

    def get_many(self, db: str, keys: Iterable[Bytes]) -> list[bytes | None]:
        """The values of ``keys`` (None where absent), read in one transaction.

        Many keys are read in key order with a cursor that jumps over every run of keys
        the db does not hold (``absent_runs_skipped``): each lmdb call releases the GIL,
        and a thread giving it up thousands of times while another runs Python waits up
        to a switch interval (5 ms) to have it back each time. New time-ordered ids
        (``new_message_id``) all fall past the db's last key: one call for the batch."""
        wanted = list(map(bytes, keys))  # bytes as they are (no copy), others copied: sortable, hashable
        handle = self._handle(db)
        with self._gate.transaction(), self._env.begin(db=handle, buffers=False) as txn:
            if len(wanted) < _CURSOR_FROM:
                return list(map(txn.get, wanted))
            found = absent_runs_skipped(txn.cursor(), sorted(set(wanted)))
        return list(map(found.get, wanted))

    def keep_highest_key(self, db: str) -> None:
        """From now on, keep in memory a key at or above every key ``db`` holds
        (``highest_key``): its last key, read here (blocking), then raised by each write
        before it commits. Deletes do not lower it. Call it before anything writes ``db``
        (at open): a write already under way when it is called may be missed."""
        handle = self._handle(db)
        self._raise_highest(db, b"")
        with self._gate.transaction(), self._env.begin(db=handle, buffers=False) as txn:
            cursor = txn.cursor()
            last = bytes(cursor.key()) if cursor.last() else b""
        self._raise_highest(db, last)

    def highest_key(self, db: str) -> bytes:
        """A key at or above every key ``db`` holds (b"" if it holds none), from memory:
        a key above it is not in ``db``, known without a read. ``db`` must be one named by
        ``keep_highest_key``."""
        return self._highest[db]

    def _raise_highest(self, db: str, key: bytes) -> None:
        with self._highest_lock:
            self._highest[db] = max(self._highest.get(db, b""), key)

    def items(self, db: str, prefix: Bytes = b"") -> list[tuple[bytes, bytes]]:
        """Every ``(key, value)`` of ``db`` whose key starts with ``prefix``, in key order."""
        handle = self._handle(db)
        prefix = bytes(prefix)
        found: list[tuple[bytes, bytes]] = []
        with self._gate.transaction(), self._env.begin(db=handle) as txn:
            cursor = txn.cursor()
            if not cursor.set_range(prefix):
                return found
            for key, value in cursor:
                if not key.startswith(prefix):
                    break
                found.append((key, value))
        return found

    # ------------------------------------------------------------- writing

    def put(self, db: str, key: Bytes, value: Bytes) -> None:
        with self.write() as batch:
            batch.put(db, key, value)

    def delete(self, db: str, key: Bytes) -> None:
        with self.write() as batch:
            batch.delete(db, key)

    def write(self) -> WriteBatch:
        """A batch of puts and deletes, applied in one transaction when the ``with`` ends."""
        self._check_open()
        return WriteBatch(self)

    def _apply(self, runs: list[Run]) -> None:
        max_key = self._max_key
        for db, deleting, items in runs:
            lengths = list(map(len, items if deleting else map(_first, items)))
            if min(lengths) == 0 or max(lengths) > max_key:
                for key in items if deleting else map(_first, items):
                    self._check_key(db, key)
        handles = {db: self._handle(db) for db in {run[0] for run in runs}}
        for db, deleting, items in runs:
            if not deleting and db in self._highest:  # raised before the commit: never below what is stored
                self._raise_highest(db, max(map(_first, items)))
        while True:
            seen_map_size = self.map_size
            try:
                with self._gate.transaction(), self._env.begin(write=True) as txn:
                    _write_runs(txn, runs, handles)
                return
            except lmdb.MapFullError:
                self._grow(seen_map_size)
            except lmdb.Error as error:
                self._raise_io_error(error, f"a write of {sum(len(run[2]) for run in runs)} change(s)")

    def _raise_io_error(self, error: lmdb.Error, what: str) -> NoReturn:
        """``StoreIOError`` for an lmdb error the disk caused (its ``OSError`` as cause); else ``error``."""
        cause = self._os_error(error)
        if cause is None:
            raise error
        raise StoreIOError(f"state store {self._folder.path}: {what} failed: {cause.strerror}") from cause

    def _os_error(self, error: lmdb.Error) -> OSError | None:
        """The ``OSError`` behind an lmdb error, which names it only in its message (None: not one)."""
        if isinstance(error, lmdb.DiskError):
            code = errno.ENOSPC
        elif os.strerror(errno.EIO) in str(error):
            code = errno.EIO
            try:
                stat = os.statvfs(self._folder.path)
                if stat.f_bavail * stat.f_frsize < LOW_SPACE:
                    code = errno.ENOSPC  # a page write cut short by the end of the free space
            except OSError:
                pass
        else:
            return None
        cause = OSError(code, os.strerror(code))
        cause.__cause__ = error
        return cause

    def _grow(self, seen_map_size: int) -> None:
        with self._gate.resize():
            current = self.map_size
            if current > seen_map_size:
                return  # another writer grew it meanwhile
            if current >= self._max_map_size:
                raise StateStoreError(
                    f"state store {self._folder.path} is full: map size {current} bytes "
                    f"has reached max_map_size {self._max_map_size}"
                )
            self._env.set_mapsize(min(current * 2, self._max_map_size))
            self._resizes += 1

    def _handle(self, db: str) -> Any:
        self._check_open()
        handle = self._dbs.get(db)
        if handle is not None:
            return handle
        if not db:
            raise ValueError("db name must not be empty")
        with self._dbs_lock:
            handle = self._dbs.get(db)
            if handle is None:
                while True:
                    seen_map_size = self.map_size
                    try:
                        # In a write transaction of its own: without one, py-lmdb begins it holding the
                        # GIL, and a thread in a write transaction waiting for the GIL deadlocks with it.
                        with self._gate.transaction(), self._env.begin(write=True) as txn:
                            handle = self._env.open_db(db.encode("utf-8"), txn=txn, create=True)
                        break
                    except lmdb.MapFullError:
                        self._grow(seen_map_size)
                    except lmdb.DbsFullError as error:
                        raise StateStoreError(
                            f"cannot open db {db!r}: the store already has max_dbs named dbs"
                        ) from error
                    except lmdb.Error as error:
                        self._raise_io_error(error, f"creating db {db!r}")
                self._dbs[db] = handle
        return handle

    def _check_key(self, db: str, key: bytes) -> None:
        if not key or len(key) > self._max_key:
            raise StateStoreError(
                f"key of {len(key)} bytes for db {db!r} is outside lmdb's limits (1 to {self._max_key} bytes)"
            )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"state store {self._folder.path} is closed")

    # ------------------------------------------------------------- closing

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._env.close()
        finally:
            self._folder.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


#: ``get_many`` of this many keys or more reads them with one cursor, in key order.
_CURSOR_FROM = 8


def absent_runs_skipped(cursor: lmdb.Cursor, wanted: list[bytes]) -> dict[bytes, bytes]:
    """``{key: value}`` of the keys of ``wanted`` (sorted, distinct) that the cursor's db holds.

    One ``set_range`` per run of wanted keys between two stored ones: it lands on the
    first stored key at or past the run's first, and every wanted key before that one
    is absent. Keys sorted as lmdb sorts them (bytes, memcmp): as many calls as there
    are such runs, at most one per key, one when none is stored among them."""
    found: dict[bytes, bytes] = {}
    i, count = 0, len(wanted)
    while i < count and cursor.set_range(wanted[i]):
        key = bytes(cursor.key())
        i = bisect_left(wanted, key, i)
        if i < count and wanted[i] == key:
            found[key] = bytes(cursor.value())
            i += 1
    return found


_first = itemgetter(0)
#: A run of a write batch: ``(db, False, [(key, value), ...])`` puts, ``(db, True, [key, ...])``
#: deletes, each into one db.
Run = tuple[str, bool, list[Any]]


def _write_runs(txn: lmdb.Transaction, runs: list[Run], handles: dict[str, Any]) -> None:
    """Apply ``runs`` in order: each run of puts with one ``putmulti`` (one call into lmdb)."""
    for db, deleting, items in runs:
        handle = handles[db]
        if not deleting:
            txn.cursor(db=handle).putmulti(items)
            continue
        for key in items:
            txn.delete(key, db=handle)


class WriteBatch:
    """Puts and deletes for one write transaction.

    ``get`` sees the batch's own pending writes first. Nothing is written if the
    ``with`` block raises. Kept as runs of puts or deletes into one db (``Run``), so a
    batch of many puts costs a list of pairs here and one ``putmulti`` at the end.
    """

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._runs: list[Run] = []
        #: The batch's own writes by key, built by the first ``get`` (most batches never read).
        self._pending: dict[tuple[str, bytes], object] | None = None

    def _run(self, db: str, deleting: bool) -> list[Any]:
        """The items of the last run if it is of ``db`` and this kind, else of a new one."""
        runs = self._runs
        if runs:
            last_db, last_deleting, items = runs[-1]
            if last_db == db and last_deleting == deleting:
                return items
        items = []
        runs.append((db, deleting, items))
        return items

    def put(self, db: str, key: Bytes, value: Bytes) -> None:
        if type(key) is not bytes:
            key = bytes(key)
        if type(value) is not bytes:
            value = bytes(value)
        self._run(db, False).append((key, value))
        if self._pending is not None:
            self._pending[(db, key)] = value

    def put_many(self, db: str, items: Iterable[tuple[bytes, bytes]]) -> None:
        """``put`` each ``(key, value)`` (both ``bytes``) into ``db``."""
        added = list(map(tuple, items))  # pairs as tuples (what putmulti takes), made in C
        if not added:
            return
        self._run(db, False).extend(added)
        if self._pending is not None:
            for key, value in added:
                self._pending[(db, key)] = value

    def delete(self, db: str, key: Bytes) -> None:
        key = bytes(key)
        self._run(db, True).append(key)
        if self._pending is not None:
            self._pending[(db, key)] = _DELETE

    def get(self, db: str, key: Bytes) -> bytes | None:
        key = bytes(key)
        if self._pending is None:
            writes: dict[tuple[str, bytes], object] = {}
            for run_db, deleting, items in self._runs:
                if deleting:
                    writes.update(((run_db, k), _DELETE) for k in items)
                else:
                    writes.update(((run_db, k), v) for k, v in items)
            self._pending = writes
        pending = self._pending.get((db, key))
        if pending is _DELETE:
            return None
        if pending is not None:
            return pending  # type: ignore[return-value]
        return self._store.get(db, key)

    def __len__(self) -> int:
        return sum(len(items) for _db, _deleting, items in self._runs)

    def __enter__(self) -> WriteBatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None and self._runs:
            self._store._apply(self._runs)
