"""The HTML report: one self-contained file, charts drawn by plotly (its JavaScript inlined once).

Six charts, always all six (an empty one says so): the future delivery curve of the
top subjects by hour and by day (stacked), what is overdue now, consumer lag per
group, the delay-horizon histogram and the delivery-lateness percentiles; then
tables of the consumer groups and of the damaged files.
"""

from __future__ import annotations

import html
from datetime import datetime
from typing import Any

import plotly.graph_objects as go

from delaymq.backlog import rows
from delaymq.backlog.view import HOURLY_DAYS, OTHER, ReportView, utc

#: (element id, title) of every chart, in page order.
CHARTS = (
    ("chart-future-hourly", "Deliveries to come, by hour"),
    ("chart-future-daily", "Deliveries to come, by day"),
    ("chart-overdue", "Overdue now"),
    ("chart-consumer-lag", "Consumer lag per group"),
    ("chart-delay-horizon", "Delay horizon: how far ahead producers schedule"),
    ("chart-lateness", "Delivery lateness: how late messages reached realtime"),
)

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.2em; margin-top: 2em; }
.totals { display: flex; flex-wrap: wrap; gap: 1em; }
.total { border: 1px solid #ddd; border-radius: 6px; padding: 0.6em 1em; min-width: 9em; }
.total b { display: block; font-size: 1.4em; }
table { border-collapse: collapse; font-size: 0.9em; margin-top: 0.5em; }
th, td { border-bottom: 1px solid #eee; padding: 0.3em 0.7em; text-align: right; }
th:first-child, td:first-child, td.text { text-align: left; }
.note { color: #666; font-size: 0.9em; }
.wide { overflow-x: auto; }
.problem { color: #a00; }
"""


def _empty(figure: go.Figure, text: str) -> go.Figure:
    figure.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 16})
    figure.update_xaxes(visible=False)
    figure.update_yaxes(visible=False)
    return figure


def _layout(figure: go.Figure, title: str, **extra: Any) -> go.Figure:
    figure.update_layout(title=title, height=420, margin={"l": 60, "r": 20, "t": 50, "b": 50},
                         legend={"orientation": "h", "y": -0.15}, **extra)  # fmt: skip
    return figure


def _curve(series: dict[str, list[tuple[datetime, int]]], title: str, empty: str) -> go.Figure:
    figure = go.Figure()
    if not series:
        return _layout(_empty(figure, empty), title)
    for subject, points in series.items():
        figure.add_trace(go.Bar(x=[t for t, _ in points], y=[m for _, m in points], name=subject))
    return _layout(figure, title, barmode="stack", yaxis_title="messages", xaxis_title="UTC")


def figures(view: ReportView) -> list[go.Figure]:
    """The six charts, in ``CHARTS`` order."""
    out = [
        _curve(view.by_hour, f"{CHARTS[0][1]} (first {HOURLY_DAYS} days)", "no scheduled messages to deliver"),
        _curve(view.by_day, CHARTS[1][1], "no scheduled messages to deliver"),
    ]
    figure = go.Figure()
    if view.overdue_by_subject:
        names = [f"{group}: {subject}" for group, subject, _o, _u in view.overdue_by_subject]
        figure.add_trace(go.Bar(x=names, y=[o for _g, _s, o, _u in view.overdue_by_subject], name="overdue"))
        figure.add_trace(go.Bar(x=names, y=[u for _g, _s, _o, u in view.overdue_by_subject], name="not yet filed"))
        _layout(
            figure,
            f"{CHARTS[2][1]} (at {utc(view.at_ms):%Y-%m-%d %H:%M:%S} UTC)",
            barmode="group",
            yaxis_title="messages",
        )
    else:
        _layout(_empty(figure, "nothing overdue, nothing waiting to be filed"), CHARTS[2][1])
    out.append(figure)
    figure = go.Figure()
    if view.consumers:
        names = [f"{c['realtime_group']}: {c['subject']} / {c['consumer_group']}" for c in view.consumers[:40]]
        for column, label in (("waiting", "not handed out"), ("redelivery_waiting", "given back, waiting"),
                              ("handed_out_unacked", "handed out, not acked"), ("retries_waiting", "retries waiting"),
                              ("dead_letters", "dead letters")):  # fmt: skip
            figure.add_trace(go.Bar(x=names, y=[c[column] for c in view.consumers[:40]], name=label))
        _layout(figure, CHARTS[3][1], barmode="group", yaxis_title="messages")
    else:
        _layout(_empty(figure, "no consumer group has pulled yet"), CHARTS[3][1])
    out.append(figure)
    figure = go.Figure()
    if view.horizon:
        for subject, counts in sorted(view.horizon.items(), key=lambda item: (item[0] == OTHER, -sum(item[1]))):
            figure.add_trace(go.Bar(x=list(rows.HORIZON_LABELS), y=counts, name=subject))
        _layout(figure, CHARTS[4][1], barmode="stack", yaxis_title="messages", xaxis_title="deliver_at - created_at")
    else:
        _layout(_empty(figure, "no scheduled messages"), CHARTS[4][1])
    out.append(figure)
    figure = go.Figure()
    if view.lateness:
        few = len({r["hour"] for r in view.lateness}) <= 48  # bars per hour; lines for a long stretch
        for subject in dict.fromkeys(r["subject"] for r in view.lateness):
            points = [r for r in view.lateness if r["subject"] == subject]
            hours: list[Any] = [utc(r["hour"]) for r in points]
            if few:
                hours = [f"{h:%Y-%m-%d %H:00}" for h in hours]
            for column, dash in (("p50_ms", "dot"), ("p99_ms", "solid"), ("max_ms", "dash")):
                name = f"{subject} {column[:-3]}"
                values = [r[column] for r in points]
                if few:
                    figure.add_trace(go.Bar(x=hours, y=values, name=name))
                else:
                    figure.add_trace(go.Scatter(x=hours, y=values, mode="lines", name=name, line={"dash": dash}))
        _layout(figure, CHARTS[5][1], barmode="group", yaxis_title="ms after deliver_at",
                xaxis_title="hour of deliver_at (UTC)")  # fmt: skip
        if few:
            figure.update_xaxes(type="category")
    else:
        _layout(_empty(figure, "no delayed message has reached a realtime server"), CHARTS[5][1])
    out.append(figure)
    return out


def _table(headers: list[str], body: list[list[Any]], *, text_columns: int = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    lines = []
    for line in body:
        cells = []
        for i, value in enumerate(line):
            shown = f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
            css = ' class="text"' if i < text_columns else ""
            cells.append(f"<td{css}>{html.escape(shown)}</td>")
        lines.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(lines)}</table>"


def render(view: ReportView) -> str:
    """The whole page."""
    charts = []
    for i, ((element, _title), figure) in enumerate(zip(CHARTS, figures(view))):
        charts.append(figure.to_html(full_html=False, include_plotlyjs=(i == 0), div_id=element,
                                     config={"displaylogo": False}))  # fmt: skip
    totals = [
        ("to deliver", f"{view.pending:,}"),
        ("bytes", f"{view.pending_bytes:,}"),
        ("overdue", f"{view.overdue:,}"),
        ("not yet filed", f"{view.unfiled:,}"),
        ("due hours", f"{view.hours:,}"),
        ("delivered (still on disk)", f"{view.dispatched:,}"),
        ("damaged files", f"{view.problem_count:,}"),
    ]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>delaymq backlog at {utc(view.at_ms):%Y-%m-%d %H:%M} UTC</title><style>{_STYLE}</style></head><body>",
        f"<h1>delaymq backlog at {utc(view.at_ms):%Y-%m-%d %H:%M:%S} UTC</h1>",
        "<p class='note'>Read from: " + html.escape(", ".join(view.sources) or "nothing") + "</p>",
        "<div class='totals'>"
        + "".join(f"<div class='total'><b>{v}</b>{html.escape(k)}</div>" for k, v in totals)
        + "</div>",
    ]
    parts += [f"<p class='note'>{html.escape(note)}</p>" for note in view.notes]
    if view.busiest:
        parts.append("<h2>Busiest hours</h2>")
        parts.append(_table(["hour (UTC)", "subject", "messages"],
                            [[f"{t:%Y-%m-%d %H:00}", s, m] for t, s, m in view.busiest], text_columns=2))  # fmt: skip
    for (element, title), chart in zip(CHARTS, charts):
        parts.append(f"<h2 id='{element}-title'>{html.escape(title)}</h2>{chart}")
    parts.append("<h2>Consumer groups</h2>")
    if view.consumers:
        columns = ["realtime_group", "subject", "consumer_group", "consumers", "stored", "waiting", "redelivery_waiting",
                   "handed_out_unacked", "retries_waiting", "dead_letters", "oldest_waiting_age_ms"]  # fmt: skip
        body = [[c[k] if c[k] is not None else "" for k in columns] for c in view.consumers]
        parts.append("<div class='wide'>" + _table(columns, body, text_columns=3) + "</div>")
    else:
        parts.append("<p class='note'>No consumer group has pulled from the realtime data read.</p>")
    parts.append("<h2>Damaged files</h2>")
    if view.problems:
        body = [[p["group"], p["file"], p["offset"], p["problem"]] for p in view.problems]
        parts.append(
            "<div class='wide'>" + _table(["group", "file", "offset", "problem"], body, text_columns=2) + "</div>"
        )
    else:
        parts.append("<p class='note'>None: every record read checked.</p>")
    parts.append(f"<p class='note'>Parquet tables (report_time={html.escape(view.report_time)}): "
                 + html.escape(", ".join(view.tables.values())) + "</p></body></html>")  # fmt: skip
    return "\n".join(parts)


__all__ = ["CHARTS", "figures", "render"]
