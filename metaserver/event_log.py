"""What the metaserver logs as the registry changes: its mastership events (promotions,
failovers, handovers), and server groups that lose or regain a live master."""

from __future__ import annotations

import logging

from delaymq.metaserver.answers import FailoverBlocked, HandoverDropped, HeardAgain, MasterChanged, StatusRow
from delaymq.metaserver.registry import Registry

# One logger name for every metaserver log line, whichever module writes it.
log = logging.getLogger("delaymq.metaserver.server")


class RegistryEventLog:
    """Logs each change once, comparing the registry with what it showed at the last look."""

    def __init__(self, registry: Registry, rows: list[StatusRow]) -> None:
        """``rows``: the registry's status at start, the first look."""
        self._registry = registry
        self._masters = live_masters(rows)
        self._seen_version = registry.version

    def notice(self, now: int, *, always: bool = False) -> None:
        """Log mastership events, and server groups that lost or regained a live master since
        the last look (taken only when the routes' version moved, unless ``always``)."""
        promoted = self._log_mastership_events()
        if not always and self._registry.version == self._seen_version:
            return
        rows = self._registry.status(now)
        masters = live_masters(rows)
        by_address = {(row.group, row.address): row for row in rows}
        for group, master in masters.items():
            before = self._masters.get(group, ...)
            if before is ... or before == master:
                continue  # a new server group (its registration was logged) or no change
            if master is None:
                row = by_address.get((group, before)) if before else None
                _log_master_lost(group, before, row)
            elif before is None:
                if group not in promoted:
                    log.info("group %s is back: its master %s heartbeats", group, master)
            elif group in promoted:
                pass  # a promotion, logged with its epoch
            elif self._registry.superseded(group).get(before) != master:  # superseding was logged
                log.info("group %s master moved from %s to %s", group, before, master)
        self._masters = masters
        self._seen_version = self._registry.version

    def _log_mastership_events(self) -> set[str]:
        """Log the registry's mastership events; the server groups whose master they changed."""
        changed: set[str] = set()
        for event in self._registry.take_events():
            if isinstance(event, MasterChanged):
                changed.add(event.group)
                _log_master_changed(event)
            elif isinstance(event, FailoverBlocked):
                log.warning(
                    "group %s: master %s silent for %.1f s, but no live in-sync slave may replace it "
                    "(in sync: %s); the group waits for its master",
                    event.group,
                    event.master,
                    event.silent_ms / 1000,
                    ", ".join(event.in_sync) or "none",
                )
            elif isinstance(event, HeardAgain):
                log.warning(
                    "heard a replicated group's server again after %.1f s of hearing none: the silence was this "
                    "metaserver's (cut off or frozen), so no master is failed over for it",
                    event.silent_ms / 1000,
                )
            elif isinstance(event, HandoverDropped):
                log.warning("group %s: handover to %s dropped: %s", event.group, event.to_address, event.reason)
        return changed


def _log_master_changed(event: MasterChanged) -> None:
    """A managed server group's new master, or its master's new term, with the reason."""
    if event.reason == "failover" and event.old is None:
        log.warning(
            "group %s: its master left the group; promoted %s (offset %s) at epoch %d",
            event.group,
            event.new,
            event.offset,
            event.epoch,
        )
    elif event.reason == "failover":
        log.warning(
            "group %s failed over: master %s silent for %.1f s; promoted %s (offset %s) at epoch %d",
            event.group,
            event.old,
            event.silent_ms / 1000,
            event.new,
            event.offset,
            event.epoch,
        )
    elif event.reason == "handover":
        log.info(
            "group %s handed over from %s to %s (offset %s) at epoch %d",
            event.group,
            event.old,
            event.new,
            event.offset,
            event.epoch,
        )
    elif event.reason == "restart":
        log.info(
            "group %s: master %s restarted%s; epoch %d",
            event.group,
            event.new,
            "" if event.old in (None, event.new) else f" (was at {event.old})",
            event.epoch,
        )
    else:
        log.info("group %s: %s is master at epoch %d", event.group, event.new, event.epoch)


def _log_master_lost(group: str, before: str | None, row: StatusRow | None) -> None:
    """A server group left without a live master: evicted (its master silent) or not."""
    if row is not None and row.evicted:
        log.info(
            "group %s evicted: no heartbeat from its master %s for %.1f s",
            group,
            before,
            row.seconds_since_heartbeat,
        )
    else:
        log.info("group %s has no live master", group)


def live_masters(rows: list[StatusRow]) -> dict[str, str | None]:
    """Each server group's live master address, or None while it has none."""
    masters: dict[str, str | None] = {}
    for row in rows:
        masters.setdefault(row.group, None)
        if row.is_master and not row.evicted:
            masters[row.group] = row.address
    return masters


__all__ = ["RegistryEventLog", "live_masters"]
