"""SecondWheel against a plain model, driven by hypothesis.

Random entries (many sharing a millisecond), part known from the heads table, the rest
arriving while the wheel runs (so some land behind the firing position), loaded in
random orders when ``seconds_to_load`` says so (sometimes only some of them: a slow
walker), popped at random increasing times and confirmed in random order. After every
step the wheel must agree with the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delaymq.wheel import HOUR_MS, SecondWheel, Tick

HOUR = 480_000
START = HOUR * HOUR_MS
FIRST_SECOND = HOUR * 3600
SPAN_MS = 6_000  # entries fall in the hour's first 6 s: dense seconds, shared ms

ms_st = st.one_of(st.integers(0, SPAN_MS - 1), st.sampled_from([0, 999, 1_000, 1_500, 4_321]))
entries_st = st.lists(ms_st, min_size=1, max_size=80)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Model:
    ms: list[int]  # ms_in_hour of entry e
    known: int  # entries 0..known-1 are filed
    loaded: set[int] = field(default_factory=set)
    fired: dict[int, int] = field(default_factory=dict)  # entry -> now when handed out
    order: list[int] = field(default_factory=list)
    confirmed: set[int] = field(default_factory=set)
    late: set[int] = field(default_factory=set)  # linked behind an already fired entry
    inexact: set[int] = field(default_factory=set)  # seconds relinked after draining

    def key(self, e: int) -> tuple[int, int]:
        return (self.ms[e], e)

    def sec(self, e: int) -> int:
        return self.ms[e] // 1000

    def counts(self) -> list[int]:
        counts = [0] * 3600
        for e in range(self.known):
            counts[self.sec(e)] += 1
        return counts

    def entries_of(self, s: int) -> list[tuple[int, int]]:
        return [(self.ms[e], e) for e in range(self.known) if self.sec(e) == s]

    def unloaded(self) -> set[int]:
        return {self.sec(e) for e in range(self.known)} - self.loaded


def check_agrees(wheel: SecondWheel, model: Model) -> None:
    known = range(model.known)
    unloaded = model.unloaded()
    waiting = [e for e in known if e not in model.fired and model.sec(e) in model.loaded]
    wake = [START + model.ms[e] for e in waiting] + [START + s * 1000 for s in unloaded]
    assert wheel.next_due_ms() == (min(wake) if wake else None)
    counts = wheel.pending()
    assert counts.scheduled == len(waiting)
    assert counts.unloaded == sum(1 for e in known if model.sec(e) in unloaded)
    assert counts.in_flight == len(model.fired) - len(model.confirmed)
    assert counts.known == model.known
    check_tick(wheel.tick(), model)


def check_tick(tick: Tick, model: Model) -> None:
    """The tick never claims an unconfirmed entry, and is exact where it can be."""
    unconfirmed = [e for e in range(model.known) if e not in model.confirmed]
    if not unconfirmed:
        last = sum(1 for e in range(model.known) if model.sec(e) == 3599)
        assert tick == Tick(FIRST_SECOND + 3599, last, model.known)
        return
    first = min(unconfirmed, key=model.key)
    s = model.sec(first)
    assert tick.second == FIRST_SECOND + s and tick.limit == model.known
    in_second = sorted(model.key(e) for e in range(model.known) if model.sec(e) == s)
    assert all(e in model.confirmed for _, e in in_second[: tick.done])
    if s not in model.inexact:
        assert tick.done == in_second.index(model.key(first))


ACTIONS = ["advance"] * 3 + ["load"] * 2 + ["arrive"] * 3 + ["confirm"] * 2


def run_steps(wheel: SecondWheel, model: Model, data: st.DataObject) -> None:
    now = START - data.draw(st.integers(0, 3_000), label="start before the hour")
    for _ in range(data.draw(st.integers(10, 60), label="steps")):
        action = data.draw(st.sampled_from(ACTIONS), label="action")
        if action == "advance":
            now += data.draw(st.integers(0, 800), label="delta")
            pop(wheel, model, now)
        elif action == "load":
            load(wheel, model, data, now)
        elif action == "arrive" and model.known < len(model.ms):
            arrive(wheel, model, data)
        elif action == "confirm":
            confirm(wheel, model, data)
        check_agrees(wheel, model)


def load(wheel: SecondWheel, model: Model, data: st.DataObject, now: int) -> None:
    ahead = data.draw(st.sampled_from([0, 3_000, 10_000]), label="ahead")
    due = sorted(s for s in model.unloaded() if START + s * 1000 <= now + ahead)
    assert wheel.seconds_to_load(now, ahead) == due
    if due and data.draw(st.booleans(), label="slow walker"):
        due = sorted(data.draw(st.sets(st.sampled_from(due)), label="walked"))
    for s in due:
        wheel.load_second(s, data.draw(st.permutations(model.entries_of(s)), label="chain"))
        model.loaded.add(s)
    if data.draw(st.booleans(), label="preload an empty second"):
        s = data.draw(st.integers(0, SPAN_MS // 1000), label="empty second")
        if s not in model.loaded and not model.entries_of(s):
            wheel.load_second(s, [])
            model.loaded.add(s)


def confirm(wheel: SecondWheel, model: Model, data: st.DataObject) -> None:
    in_flight = sorted(set(model.fired) - model.confirmed)
    how = data.draw(st.sampled_from(["all", "oldest", "any"]), label="confirm how")
    if how == "all" or not in_flight:
        chosen = in_flight
    elif how == "oldest":  # the realtime server accepted the first k sent
        chosen = sorted(in_flight, key=model.key)[: data.draw(st.integers(0, len(in_flight)))]
    else:
        chosen = sorted(data.draw(st.sets(st.sampled_from(in_flight)), label="confirm"))
    if data.draw(st.booleans(), label="confirm in one call"):
        items = [(START + model.ms[e], e) for e in chosen]
        assert wheel.mark_done_many(items) == len(chosen)
        assert wheel.mark_done_many(items) == 0
        model.confirmed.update(chosen)
        return
    for e in chosen:
        assert wheel.mark_done(START + model.ms[e], e)
        assert not wheel.mark_done(START + model.ms[e], e)
        model.confirmed.add(e)


def arrive(wheel: SecondWheel, model: Model, data: st.DataObject | None = None) -> None:
    """The next entry arrives (``link`` or ``note_arrival``), or, drawn, the next ones in one
    ``arrive_many`` call, which must do the same."""
    left = len(model.ms) - model.known
    many = data.draw(st.integers(0, min(left, 5)), label="arrivals in one call (0: one by one)") if data else 0
    first = model.known
    arrivals = range(first, first + max(many, 1))
    linked = [e for e in arrivals if model.sec(e) in model.loaded]
    if many:
        assert wheel.arrive_many(first, model.ms[first : first + many]) == linked
    else:
        s = model.sec(first)
        assert wheel.is_loaded(s) == (s in model.loaded)
        if linked:
            wheel.link(s, model.ms[first], first)
        else:
            wheel.note_arrival(s)
    for e in arrivals:  # the model's side, the same either way
        s = model.sec(e)
        before = [x for x in range(e) if model.sec(x) == s]
        if s in model.loaded and before and all(x in model.confirmed for x in before):
            model.inexact.add(s)  # its memory was freed: the tick may claim less
        if any(model.key(x) > model.key(e) for x in model.fired):
            model.late.add(e)
        model.known += 1


def pop(wheel: SecondWheel, model: Model, now: int) -> None:
    fired = wheel.pop_due(now)
    assert fired == sorted(fired), "a batch comes out in firing order"
    for at, e in fired:
        assert e < model.known and e not in model.fired, "each entry fires exactly once"
        assert at == START + model.ms[e] <= now, "never before its millisecond"
        model.fired[e] = now
        model.order.append(e)
    # Whatever is due and loaded went out, unless an earlier due second is not walked.
    unwalked_due = [s for s in model.unloaded() if START + s * 1000 <= now]
    for e in range(model.known):
        if e not in model.fired and model.sec(e) in model.loaded and START + model.ms[e] <= now:
            assert unwalked_due and min(unwalked_due) < model.sec(e)


def finish(wheel: SecondWheel, model: Model) -> None:
    while model.known < len(model.ms):
        arrive(wheel, model)
    end = START + HOUR_MS
    for s in wheel.seconds_to_load(end):
        wheel.load_second(s, model.entries_of(s))
        model.loaded.add(s)
    pop(wheel, model, end)
    check_agrees(wheel, model)
    assert sorted(model.fired) == list(range(len(model.ms))), "nothing lost"
    on_time = [e for e in model.order if e not in model.late]
    assert on_time == sorted(on_time, key=model.key), "fired in (ms, entry) order"
    for e in sorted(set(model.fired) - model.confirmed):
        assert wheel.mark_done(START + model.ms[e], e)
        model.confirmed.add(e)
    assert wheel.is_done() and wheel.next_due_ms() is None
    check_agrees(wheel, model)


@SETTINGS
@given(entries_st, st.data())
def test_fires_each_entry_once_in_order_never_early(ms, data):
    model = Model(ms=ms, known=data.draw(st.integers(0, len(ms)), label="known at start"))
    wheel = SecondWheel.from_counts(HOUR, model.counts())
    check_agrees(wheel, model)
    run_steps(wheel, model, data)
    finish(wheel, model)


def claimed(tick: Tick, model: Model, known: int) -> set[int]:
    """Entries (of the first ``known``) that ``tick`` says are done."""
    if tick.second < FIRST_SECOND:
        return set()
    if tick.second >= FIRST_SECOND + 3600:
        return set(range(known))
    s = tick.second - FIRST_SECOND
    covered = range(min(known, tick.limit))
    in_second = sorted(model.key(e) for e in covered if model.sec(e) == s)
    return {e for e in covered if model.sec(e) < s} | {e for _, e in in_second[: tick.done]}


@SETTINGS
@given(entries_st, st.data())
def test_a_new_master_starting_from_the_tick_loses_nothing(ms, data):
    # The old master runs a while, then its last tick goes to a slave.
    model = Model(ms=ms, known=data.draw(st.integers(0, len(ms)), label="known at start"))
    master = SecondWheel.from_counts(HOUR, model.counts())
    run_steps(master, model, data)
    tick = master.tick()
    assert claimed(tick, model, model.known) <= model.confirmed
    # The slave's index may lag the master's or be ahead of it; its dispatch log may
    # hold any confirmed entries.
    slave_known = data.draw(st.one_of(st.just(model.known), st.integers(0, len(ms))), label="slave known")
    confirmed = sorted(model.confirmed)
    logged = data.draw(st.sets(st.sampled_from(confirmed)), label="log") if confirmed else set()
    slave = SecondWheel.from_counts(HOUR, Model(ms=ms, known=slave_known).counts())
    slave.mark_delivered(logged)
    slave.skip_to(tick)
    for e in range(slave_known, len(ms)):  # later filings reach the slave as arrivals
        s = model.sec(e)
        if slave.is_loaded(s):
            slave.link(s, ms[e], e)
        else:
            slave.note_arrival(s)
    everything = Model(ms=ms, known=len(ms))
    end = START + HOUR_MS
    for s in slave.seconds_to_load(end):
        floor = slave.walk_floor(s)  # a walk may stop there, or go on
        stop = data.draw(st.booleans(), label="stop at floor")
        chain = [(m, e) for m, e in everything.entries_of(s) if e >= floor or not stop]
        slave.load_second(s, data.draw(st.permutations(chain), label="slave chain"))
    fired = []
    for at, e in slave.pop_due(end):
        assert at == START + ms[e]
        fired.append(e)
    assert len(fired) == len(set(fired)), "each fires at most once"
    unconfirmed = set(range(len(ms))) - model.confirmed
    assert unconfirmed <= set(fired), "nothing undelivered is skipped"
    if slave_known >= model.known:
        # An exact tick: the rest fires, and nothing the tick or the log covers.
        assert set(fired) == set(range(len(ms))) - claimed(tick, model, slave_known) - logged
