"""The registry's refusals: each names the request or snapshot field that was wrong."""

from __future__ import annotations


class RegistryError(ValueError):
    """A refused request or snapshot; ``field`` names what was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class Superseded(RegistryError):
    """A heartbeat or registration from a master that another server has superseded."""

    def __init__(self, group: str, address: str, by: str) -> None:
        super().__init__(
            "address",
            f"{address} was superseded as master of group {group!r} by {by} (the newest registration "
            "wins); it is not routed: restart it to register again, or register it as a slave",
        )
        self.by = by


class MemberTaken(RegistryError):
    """A registration claiming the member id of a live server of another run at another address."""

    def __init__(self, group: str, member: str, claimant: str, address: str, silent_ms: int, evict_in_ms: int) -> None:
        super().__init__(
            "member",
            f"member {member!r} of group {group!r} is live at {address} (heard from {silent_ms / 1000:.1f} s "
            f"ago), registered by another run of the server: {claimant} may not take its place. If {claimant} "
            f"is that member restarted, stop the process at {address}, or wait until it has been silent "
            f"{evict_in_ms / 1000:.1f} s more (it registers by itself then); otherwise give {claimant} a data "
            "folder of its own (a copied folder: delete its 'member' file)",
        )
        self.member = member
        self.address = address


__all__ = ["MemberTaken", "RegistryError", "Superseded"]
