"""The permission model: for any tokens file and any request, the table decides as a small reference does.

The reference below is written from the documented rules (docs/operations.md,
"Authentication and permissions"), not from the code: which roles each command
needs, which commands name subjects and consumer groups, who may speak as a
server, and the group of a retry or dead-letter subject.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from hypothesis import given, settings
from hypothesis import strategies as st

from delaymq.net.auth import AuthRefusal, Identity, Scope, parse_tokens
from delaymq.protocol.commands import Command

P, C, A, S = "producer", "consumer", "admin", "server"
#: command: (roles of which one is needed (empty: any token), names subjects, names a consumer group)
REFERENCE: dict[Command, tuple[frozenset[str], bool, bool]] = {
    Command.PING: (frozenset(), False, False),
    Command.ROUTE: (frozenset(), False, False),
    Command.STATUS: (frozenset(), False, False),
    Command.REGISTER: (frozenset({S}), False, False),
    Command.HEARTBEAT: (frozenset({S}), False, False),
    Command.FETCH: (frozenset({S}), False, False),
    Command.SET_STATE: (frozenset({A}), False, False),
    Command.HANDOVER: (frozenset({A}), False, False),
    Command.CLEAR_FENCE: (frozenset({A}), False, False),
    Command.SEND: (frozenset({P, S}), True, False),
    Command.SCHEDULE: (frozenset({P, S}), True, False),
    Command.CANCEL: (frozenset({P}), True, False),
    Command.MOVE: (frozenset({P}), True, False),
    Command.QUERY: (frozenset({P}), True, False),
    Command.PULL: (frozenset({C}), True, True),
    Command.ACK: (frozenset({C}), True, True),
    Command.NACK: (frozenset({C}), True, True),
    Command.CONSUMER_HEARTBEAT: (frozenset({C}), True, True),
}

SUBJECT_PATTERNS = ["*", "orders.*", "payments", "orders.e?"]
GROUP_PATTERNS = ["*", "billing*", "ops"]
SERVER_PATTERNS = ["*", "scheduler:*", "realtime:rt-1", "realtime:rt-*", "scheduler:sched-[12]"]
SUBJECTS = ["orders.eu", "orders.us.paid", "payments", "orders", "%retry%billing%orders.eu", "%dead%ops%payments"]
GROUPS = ["billing", "billing-eu", "ops", "shipping"]
SERVERS = [("scheduler", "sched-1"), ("scheduler", "sched-3"), ("realtime", "rt-1"), ("realtime", "rt-2")]


@dataclass(frozen=True)
class Entry:
    secret: str
    roles: frozenset[str]
    subjects: tuple[str, ...] | None
    groups: tuple[str, ...] | None
    servers: tuple[str, ...] | None

    def toml(self, number: int) -> str:
        lines = [
            "[[token]]",
            f'name = "t{number}"',
            f'token = "{self.secret}"',
            f"roles = {sorted(self.roles)!r}",
        ]
        for key in ("subjects", "groups", "servers"):
            value = getattr(self, key)
            if value is not None:
                lines.append(f"{key} = {list(value)!r}")
        return "\n".join(lines) + "\n"


def _patterns(pool: list[str]) -> st.SearchStrategy[tuple[str, ...] | None]:
    return st.none() | st.lists(st.sampled_from(pool), min_size=1, max_size=3, unique=True).map(tuple)


@st.composite
def entries(draw: st.DrawFn, number: int) -> Entry:
    roles = frozenset(draw(st.lists(st.sampled_from([P, C, A, S, "metrics"]), min_size=1, max_size=4, unique=True)))
    servers = draw(_patterns(SERVER_PATTERNS)) if S in roles else None
    return Entry(
        f"secret-{number:02d}-0123456789",
        roles,
        draw(_patterns(SUBJECT_PATTERNS)),
        draw(_patterns(GROUP_PATTERNS)),
        servers,
    )


@st.composite
def scopes(draw: st.DrawFn) -> Scope:
    subjects = draw(st.none() | st.lists(st.sampled_from(SUBJECTS), max_size=3).map(tuple))
    return Scope(subjects, draw(st.none() | st.sampled_from(GROUPS)), draw(st.none() | st.sampled_from(SERVERS)))


def _carried(subject: str) -> tuple[str, str | None]:
    """(the subject it carries messages of, the group it belongs to) of a retry or dead-letter subject."""
    for prefix in ("%retry%", "%dead%"):
        if subject.startswith(prefix) and "%" in subject[len(prefix) :]:
            group, _, base = subject[len(prefix) :].partition("%")
            return base, group
    return subject, None


def expected(entry: Entry, command: Command, scope: Scope) -> str | None:
    """The field the reference refuses on, or None when the request is allowed."""
    needed, names_subjects, names_group = REFERENCE[command]
    subjects = entry.subjects or ("*",)
    groups = entry.groups or ()

    def group_allowed(group: str) -> bool:
        return A in entry.roles or any(fnmatchcase(group, pattern) for pattern in groups)

    if needed and not needed & entry.roles:
        return "role"
    if scope.server is not None:
        kind, group = scope.server
        if S not in entry.roles or not any(fnmatchcase(f"{kind}:{group}", p) for p in entry.servers or ()):
            return "servers"
    if names_group and scope.group is not None and not group_allowed(scope.group):
        return "group"
    if not names_subjects:
        return None
    if scope.subjects is None:
        return None if "*" in subjects else "subject"
    for subject in scope.subjects:
        base, group = _carried(subject)
        if not any(fnmatchcase(base, pattern) for pattern in subjects):
            return "subject"
        if group is not None and not entry.roles & {S, A} and not group_allowed(group):
            return "group"
    return None


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    count=st.integers(min_value=1, max_value=4),
)
def test_every_decision_equals_the_reference(data: st.DataObject, count: int) -> None:
    tokens = [data.draw(entries(number)) for number in range(count)]
    table = parse_tokens("\n".join(entry.toml(n) for n, entry in enumerate(tokens)))
    for _ in range(20):
        entry = data.draw(st.sampled_from(tokens))
        command = data.draw(st.sampled_from(sorted(REFERENCE)))
        scope = data.draw(scopes())
        decision = table.check(entry.secret, command, scope)
        want = expected(entry, command, scope)
        if want is None:
            assert isinstance(decision, Identity), (command.name, scope, decision)
        else:
            assert isinstance(decision, AuthRefusal), (command.name, scope, want)
            assert decision.field == want, (command.name, scope, decision)
            assert decision.code == "forbidden"
