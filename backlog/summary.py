"""The plain-text summary printed at the end of a run."""

from __future__ import annotations

from delaymq.backlog.view import ReportView, utc


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def text(view: ReportView) -> str:
    at = utc(view.at_ms)
    lines = [f"delaymq backlog at {at:%Y-%m-%d %H:%M:%S} UTC (report_time {view.report_time})"]
    lines += [f"  read: {source}" for source in view.sources]
    lines += [f"  note: {note}" for note in view.notes]
    if view.pending or view.dispatched:
        lines.append(
            f"scheduled: {view.pending:,} messages to deliver ({_size(view.pending_bytes)}) in {view.hours:,} hours; "
            f"{view.overdue:,} overdue, {view.unfiled:,} not yet filed, {view.dispatched:,} delivered and still on disk"
        )
        for hour, subject, messages in view.busiest[:3]:
            lines.append(f"  busiest: {hour:%Y-%m-%d %H:00} UTC  {subject}  {messages:,}")
        for group, subject, overdue, _unfiled in view.overdue_by_subject[:5]:
            if overdue:
                lines.append(f"  overdue: {group} {subject}  {overdue:,}")
    else:
        lines.append("scheduled: no scheduled messages found")
    behind = [c for c in view.consumers if c["waiting"] or c["handed_out_unacked"] or c["retries_waiting"]]
    if view.consumers:
        lines.append(
            f"consumers: {len(view.consumers):,} group(s) and subject(s); {len(behind):,} with messages waiting"
        )
        for c in behind[:5]:
            age = c["oldest_waiting_age_ms"]
            oldest = f", oldest waiting {age / 1000:,.1f} s" if age is not None else ""
            lines.append(
                f"  {c['realtime_group']} {c['subject']} / {c['consumer_group']}: {c['waiting']:,} not handed out, "
                f"{c['handed_out_unacked']:,} unacked, {c['retries_waiting']:,} retries, "
                f"{c['dead_letters']:,} dead letters{oldest}"
            )
    else:
        lines.append("consumers: no consumer group found")
    worst = view.lateness_worst
    if worst:
        lines.append(
            f"lateness: worst hour {utc(worst['hour']):%Y-%m-%d %H:00} UTC on {worst['subject']}: "
            f"p50 {worst['p50_ms']:,} ms, p99 {worst['p99_ms']:,} ms, max {worst['max_ms']:,} ms"
        )
    if view.problem_count:
        lines.append(f"damaged files: {view.problem_count:,} (listed in the report and the problems table)")
        for p in view.problems[:5]:
            lines.append(f"  {p['file']} at byte {p['offset']:,}: {p['problem']}")
    else:
        lines.append("damaged files: none")
    if view.tables:
        lines.append("tables: " + ", ".join(view.tables.values()))
    if view.html:
        lines.append(f"report: {view.html}")
    return "\n".join(lines)


__all__ = ["text"]
