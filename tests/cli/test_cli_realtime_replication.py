"""Realtime replication on the command line: ``delaymq realtime --replication/--min-insync``,
what ``delaymq status`` prints of a realtime group's members, and ``delaymq bench`` wiring.

No server runs here: STATUS answers are canned in the shape the realtime server gives
(``statistics`` with ``role``, ``epoch``, ``master`` and ``replication``, the same keys as
a scheduler's). tests/cli/test_cli_realtime_replication_cluster.py runs the real thing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from delaymq.bench import failover as bench_failover
from delaymq.bench.failover import Tally
from delaymq.cli.main import main, parse_args
from delaymq.cli.status_command import format_member, format_realtime, format_scheduler

MASTER, SLAVE, OTHER = "127.0.0.1:7301", "127.0.0.1:7302", "127.0.0.1:7303"


def realtime_answer(address: str, **statistics: Any) -> dict[str, Any]:
    """A realtime server's STATUS answer (command 14) with these statistics over plain counters."""
    counters = {"messages_stored": 1200, "messages_delivered": 1100, "acks": 1000, "consumers": 2}
    return {
        "group": "realtime-1",
        "address": address,
        "now_ms": 1_700_000_000_000,
        "fences": {"scheduler-1": 3},
        "statistics": {**counters, "message_log_end": 183_000, **statistics},
    }


MASTER_REPLICATION = {
    "mode": "sync",
    "min_insync": 1,
    "durable_end": 183_000,
    "history": [[1, 0], [2, 90_000]],
    "cut_records": 0,
    "cut_bytes": 0,
    "high_watermark": 183_000,
    "replicas": [
        {"address": SLAVE, "acked": 183_000, "lag_bytes": 0, "lag_ms": 0, "in_sync": True, "seconds_since_fetch": 0.01},
        {"address": OTHER, "acked": 90_000, "lag_bytes": 93_000, "lag_ms": -1, "in_sync": False, "seconds_since_fetch": 12.5},
    ],
    "accepting": True,
}  # fmt: skip

SLAVE_REPLICATION = {
    "mode": "sync",
    "min_insync": 1,
    "durable_end": 182_000,
    "history": [[1, 0], [2, 90_000]],
    "cut_records": 4,
    "cut_bytes": 700,
    "master_durable_end": 183_000,
    "lag_bytes": 1_000,
    "fetches": 310,
    "fetch_failures": 0,
    "applied_offset": 181_500,
}


# -- delaymq realtime --replication / --min-insync --------------------------------------


def test_realtime_takes_replication_options_with_the_schedulers_defaults() -> None:
    realtime = parse_args(["realtime", "--data", "d"])
    scheduler = parse_args(["scheduler", "--data", "d"])
    assert (realtime.replication, realtime.min_insync) == (scheduler.replication, scheduler.min_insync) == ("sync", 0)
    chosen = parse_args(["realtime", "--data", "d", "--group", "rt-2", "--replication", "async", "--min-insync", "2"])
    assert (chosen.group, chosen.replication, chosen.min_insync) == ("rt-2", "async", 2)


def test_realtime_replication_options_come_from_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "delaymq.toml"
    config.write_text('[realtime]\ndata = "/srv/rt"\nreplication = "async"\nmin-insync = 0\n')
    args = parse_args(["--config", str(config), "realtime"])
    assert (args.replication, args.min_insync) == ("async", 0)


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--min-insync", "-1"], "argument --min-insync: -1 must be 0 or more"),
        (["--min-insync", "one"], "argument --min-insync: 'one' is not a whole number"),
        (["--replication", "quorum"], "argument --replication: invalid choice: 'quorum'"),
    ],
)
def test_bad_replication_options_are_refused_naming_the_option(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["realtime", "--data", "d", *argv])
    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_realtime_help_says_what_sync_replication_holds_back(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["realtime", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines, at hyphens too
    assert "answeraSEND,PULLorACKonlyonceeveryslaveofthegroup'sin-syncsetholdsit(sync),oratonce(async)" in text
    assert "--min-insyncN" in text and "refused(retryable)andnothingisstored.0:amemberaloneserves" in text
    assert "(default:0)" in text


# -- delaymq status: one rendering for both kinds -----------------------------------------


def test_a_realtime_master_shows_role_epoch_and_each_slaves_lag() -> None:
    answer = realtime_answer(MASTER, role="master", epoch=2, master=MASTER, replication=MASTER_REPLICATION)
    lines = format_realtime("realtime-1", MASTER, answer).splitlines()
    assert lines == [
        f"realtime realtime-1 at {MASTER}: master (epoch 2), 1200 stored, 1100 handed out, 1000 acked, "
        "2 consumers, message log end 183000",
        "  replication sync, min-insync 1, durable log end 183000",
        f"  slave {SLAVE}: in sync, lag 0 bytes / 0 ms",
        f"  slave {OTHER}: OUT OF SYNC, lag 93000 bytes / ? ms",
        "  scheduler epochs accepted: scheduler-1 3",
    ]


def test_a_realtime_slave_shows_its_master_lag_applied_offset_and_cut() -> None:
    answer = realtime_answer(SLAVE, role="slave", epoch=2, master=MASTER, replication=SLAVE_REPLICATION)
    lines = format_realtime("realtime-1", SLAVE, answer).splitlines()
    assert lines[0].startswith(f"realtime realtime-1 at {SLAVE}: slave (epoch 2) of {MASTER}, 1200 stored")
    assert lines[1:4] == [
        "  replication sync, min-insync 1, durable log end 182000",
        "  behind the master by 1000 bytes; applied up to offset 181500",
        "  cut 4 record(s) the master never had",
    ]


def test_a_standalone_realtime_server_and_one_that_does_not_answer() -> None:
    standalone = realtime_answer(MASTER, fences={})
    standalone["fences"] = {}
    assert format_realtime("realtime-1", MASTER, standalone).splitlines() == [
        f"realtime realtime-1 at {MASTER}: master (epoch 0), 1200 stored, 1100 handed out, 1000 acked, "
        "2 consumers, message log end 183000"
    ]
    silent = format_realtime("realtime-1", OTHER, {"error": "cannot connect"})
    assert silent == f"realtime realtime-1 at {OTHER}: no status (cannot connect)"


def test_scheduler_and_realtime_members_are_introduced_by_the_same_function() -> None:
    realtime = realtime_answer(SLAVE, role="slave", epoch=4, master=MASTER, replication=SLAVE_REPLICATION)
    held = {key: value for key, value in SLAVE_REPLICATION.items() if key != "applied_offset"}
    scheduler_stats = {"role": "slave", "epoch": 4, "master": MASTER, "replication": held}
    scheduler = {
        "role": "slave",
        "epoch": 4,
        "tick": {"hour": "2024010100", "second": 0},
        "statistics": scheduler_stats,
    }
    assert (
        format_member("realtime", "realtime-1", SLAVE, realtime)
        == f"realtime realtime-1 at {SLAVE}: slave (epoch 4) of {MASTER}"
    )
    assert format_scheduler("scheduler-1", SLAVE, scheduler).startswith(
        f"scheduler scheduler-1 at {SLAVE}: slave (epoch 4) of {MASTER}, tick 2024010100 00:00:00 UTC"
    )
    # A scheduler slave's line adds its held tick to the same lag line.
    held.update(tick_age_ms=40, tick_behind_ms=45)
    assert "  behind the master by 1000 bytes; tick held 40 ms ago, 45 ms behind the master's clock" in (
        format_scheduler("scheduler-1", SLAVE, scheduler).splitlines()
    )


# -- delaymq bench ------------------------------------------------------------------------


def test_bench_failover_realtime_runs_the_realtime_failover(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[dict[str, Any]] = []

    def fake(scratch: Path, **options: Any) -> list[tuple[str, float, str]]:
        calls.append(options)
        return [("kill to promotion", 4321.0, "ms")]

    monkeypatch.setattr(bench_failover, "bench_failover", fake)
    assert main(["bench", "failover", "--realtime"]) == 0
    assert calls == [{"realtime": True}]
    out = capsys.readouterr().out
    assert "== failover --realtime" in out and "kill to promotion" in out and "4,321.0 ms" in out


def test_bench_realtime_option_goes_with_failover_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codec", "--realtime"]) == 2
    assert "--realtime goes with the failover suite" in capsys.readouterr().err


def test_the_bench_tells_marked_re_hand_outs_from_duplicates() -> None:
    tally = Tally()
    tally.attempts = {
        "once": [0],
        "marked": [0, 1],  # handed out again after a failover, its attempts raised
        "marked-twice": [0, 1, 2],
        "duplicate": [0, 0],  # handed out again, not marked: the consumer cannot tell
        "back-then-same": [0, 1, 1],
    }
    assert tally.handed_out_again() == (4, 2)
