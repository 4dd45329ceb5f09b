"""What a partition scenario's load wrote (``load.py``), read back and judged.

The test's process reads the files as the load appends them: the watcher's STATUS samples (to
know roles, epochs and who is in sync), the acknowledged batches, which server answered each
write, and every receipt. From them, after the run: what was lost, early or duplicated, the
lateness, when service was back after the heal, and whether a deposed master acknowledged a write.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class JsonLines:
    """A JSON-lines file another process appends to, read as it grows (whole lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._offset = 0

    def read(self) -> list[dict[str, Any]]:
        if self.path.exists():
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
            end = data.rfind(b"\n") + 1  # a line still being written is read next time
            self.rows.extend(json.loads(line) for line in data[:end].splitlines())
            self._offset += end
        return self.rows


@dataclass
class Observations:
    """The load's output folder, read as it grows."""

    out: Path
    status: JsonLines = field(init=False)
    acked: JsonLines = field(init=False)
    answers: JsonLines = field(init=False)
    received: JsonLines = field(init=False)

    def __post_init__(self) -> None:
        for name in ("status", "acked", "answers", "received"):
            setattr(self, name, JsonLines(self.out / f"{name}.jsonl"))

    def meta_rows(self) -> list[dict[str, Any]]:
        """The metaserver's rows at its latest answer (empty before the first)."""
        for row in reversed(self.status.read()):
            if "rows" in row:
                return list(row["rows"])
        return []

    def master_of(self, group: str) -> str | None:
        """The address the metaserver last named master of ``group``."""
        masters = [r["address"] for r in self.meta_rows() if r["group"] == group and r["role"] == "master"]
        return masters[0] if masters else None

    def ready(self, groups: dict[str, int]) -> bool:
        """Each group (name: its slaves) has a master and that many slaves in sync, as the metaserver says."""
        rows = self.meta_rows()
        for group, slaves in groups.items():
            mine = [r for r in rows if r["group"] == group]
            in_sync = [r for r in mine if r["role"] == "slave" and r["in_sync"]]
            if sum(r["role"] == "master" for r in mine) != 1 or len(in_sync) < slaves:
                return False
        return True

    def acknowledged(self) -> int:
        return sum(len(row["ids"]) for row in self.acked.read())


@dataclass
class Verdict:
    """What the load saw, as the printed line and the assertions use it."""

    acknowledged: int = 0
    delivered: int = 0
    lost: list[str] = field(default_factory=list)
    early: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)  # received again, attempts not raised
    redelivered: int = 0  # received again with attempts raised: the consumer can tell
    lateness_ms: list[int] = field(default_factory=list)  # first receipt - deliver_at, per delivered id
    service_back_ms: int | None = None  # heal to service back; None: not back by the end
    longest_ack_gap_ms: int = 0
    lost_answered_by: list[str] = field(default_factory=list)  # which server acknowledged the lost ones, when
    two_masters: list[str] = field(default_factory=list)
    unattributed_writes: int = 0  # answers the STATUS samples could not place in one master's epoch
    master_epochs: dict[str, int] = field(default_factory=dict)  # group: epochs whose master was seen

    def percentile(self, share: float) -> int:
        ordered = sorted(self.lateness_ms)
        return ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)) - 1)] if ordered else 0


def judge(observations: Observations, groups: dict[str, str], *, healed_at: int, served_within_ms: int) -> Verdict:
    """The verdict on a finished load; ``groups`` maps each server address to its group."""
    batches = observations.acked.read()
    receipts = observations.received.read()
    due = {i: d for row in batches for i, d in zip(row["ids"], row["due"])}
    verdict = Verdict(acknowledged=len(due))
    firsts = _delivery(verdict, due, receipts)
    verdict.service_back_ms = service_back_ms(batches, firsts, due, healed_at=healed_at, within_ms=served_within_ms)
    verdict.longest_ack_gap_ms = longest_gap_ms(batches)
    answers = observations.answers.read()
    verdict.lost_answered_by = answered_by(answers, set(verdict.lost))
    samples = [row for row in observations.status.read() if "role" in row]
    verdict.two_masters = same_epoch_masters(samples)
    for group in {row["group"] for row in samples}:
        epochs = {row["epoch"] for row in samples if row["group"] == group and row["role"] == "master"}
        verdict.master_epochs[group] = len(epochs)
    deposed, unattributed = deposed_acknowledgements(samples, answers, groups)
    verdict.two_masters += deposed
    verdict.unattributed_writes = unattributed
    return verdict


def _delivery(verdict: Verdict, due: dict[str, int], receipts: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Fill in lost, early, duplicated, redelivered and lateness; the first receipt time of each id."""
    attempts: dict[str, list[int]] = defaultdict(list)
    firsts: dict[str, int] = {}
    for row in receipts:
        attempts[row["id"]].append(row["attempts"])
        firsts.setdefault(row["id"], row["at"])
        # Early by the deliver_at sent or the one delivered (a past one is rewritten to its arrival).
        if row["at"] < max(row["due"], due.get(row["id"], 0)):
            verdict.early.append(row["id"])
    for ident, counts in attempts.items():
        for n, count in enumerate(counts[1:], start=1):
            if count > max(counts[:n]):
                verdict.redelivered += 1
            else:
                verdict.duplicated.append(ident)
    verdict.delivered = len(firsts.keys() & due.keys())
    verdict.lost = sorted(due.keys() - firsts.keys())
    verdict.lateness_ms = [firsts[i] - due[i] for i in due.keys() & firsts.keys()]
    return firsts


def service_back_ms(
    batches: Sequence[dict[str, Any]], firsts: dict[str, int], due: dict[str, int], *, healed_at: int, within_ms: int
) -> int | None:
    """From the heal until service is whole again: a batch acknowledged and a message delivered, each
    within ``within_ms`` (of its first try, of its deliver_at), and nothing slower finishing after.

    Each event is (started, finished): a batch's first try and acknowledgement, a message's deliver_at
    and first receipt. None: no timely write or no timely delivery after the heal."""
    writes = [(row["first_try"], row["acked"]) for row in batches]
    deliveries = [(due[i], at) for i, at in firsts.items() if i in due]
    back = healed_at
    for events in (writes, deliveries):
        timely = [end for start, end in events if end >= healed_at and end - start <= within_ms]
        if not timely:
            return None
        back = max(back, min(timely))
    slow = [end for start, end in (*writes, *deliveries) if end > healed_at and end - start > within_ms]
    return max([back, *slow]) - healed_at


def longest_gap_ms(batches: Sequence[dict[str, Any]]) -> int:
    """The longest a producer stream went between two acknowledgements (each stream on its own:
    the scheduled ones and the immediate ones go to different groups)."""
    streams: dict[int, list[int]] = defaultdict(list)
    for row in batches:
        streams[row["stream"]].append(row["acked"])
    gaps = [b - a for times in streams.values() for a, b in zip(times, times[1:])]
    return max(gaps, default=0)


def answered_by(answers: Sequence[dict[str, Any]], ids: set[str]) -> list[str]:
    """Which server answered the writes of ``ids``, how many and from when to when: where lost ones went."""
    spans: dict[str, list[int]] = {}
    for answer in answers:
        count = len(ids.intersection(answer["ids"]))
        if count:
            span = spans.setdefault(answer["address"], [0, answer["answered"], answer["answered"]])
            span[0] += count
            span[1], span[2] = min(span[1], answer["answered"]), max(span[2], answer["answered"])
    return [f"{address}: {n} answered from {first} to {last}" for address, (n, first, last) in spans.items()]


def same_epoch_masters(samples: Iterable[dict[str, Any]]) -> list[str]:
    """Two members that each said they were master of one group in one epoch."""
    masters: dict[tuple[str, int], set[str]] = defaultdict(set)
    for row in samples:
        if row["role"] == "master":
            masters[(row["group"], row["epoch"])].add(row["address"])
    return [f"{group} epoch {epoch}: masters {sorted(a)}" for (group, epoch), a in masters.items() if len(a) > 1]


def deposed_acknowledgements(
    samples: Sequence[dict[str, Any]], answers: Sequence[dict[str, Any]], groups: dict[str, str]
) -> tuple[list[str], int]:
    """Writes acknowledged by a master of one epoch that were asked for after a member of a newer
    epoch of its group had said it was master (its STATUS) or had acknowledged a write: two masters
    taking writes at once. The newer master no longer fetched from the old one by then, so it
    cannot hold such a write: under sync replication the old master must refuse it.

    An answer belongs to epoch E when its server's STATUS said "master of E" both in a sample
    taken before the write was asked and in one asked for after it was answered (a member's
    epoch only goes up, so it was master of E all along). Answers with no such pair are counted,
    not judged. Returns the violations and that count."""
    by_address: dict[str, list[dict[str, Any]]] = defaultdict(list)
    since: dict[tuple[str, int], int] = {}  # (group, epoch): when a master of it was first seen
    for row in samples:
        by_address[row["address"]].append(row)
        if row["role"] == "master":
            key = (row["group"], row["epoch"])
            since[key] = min(since.get(key, row["at"]), row["at"])
    placed: list[tuple[str, int, dict[str, Any]]] = []
    unattributed = 0
    for answer in answers:
        epoch = _epoch_around(by_address.get(answer["address"], []), answer["asked"], answer["answered"])
        if epoch is None:
            unattributed += 1
        else:
            group = groups.get(answer["address"], "?")
            placed.append((group, epoch, answer))
            since[(group, epoch)] = min(since.get((group, epoch), answer["answered"]), answer["answered"])
    violations = []
    for group, epoch, answer in placed:
        newer = sorted((t, e) for (g, e), t in since.items() if g == group and e > epoch and t < answer["asked"])
        if newer:
            violations.append(
                f"{group}: {answer['address']} (epoch {epoch}) acknowledged {answer['ids'][:3]} asked at "
                f"{answer['asked']}, after a master of epoch {newer[0][1]} was seen at {newer[0][0]}"
            )
    return violations, unattributed


def _epoch_around(samples: Sequence[dict[str, Any]], asked: int, answered: int) -> int | None:
    """The epoch a member was master of from before ``asked`` until after ``answered``, if its samples show it."""
    before = [s for s in samples if s["at"] <= asked]
    after = [s for s in samples if s["asked"] >= answered]
    if not before or not after:
        return None
    first, last = before[-1], after[0]
    if first["role"] == last["role"] == "master" and first["epoch"] == last["epoch"]:
        return int(first["epoch"])
    return None
