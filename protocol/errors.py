"""The protocol layer's errors: who broke the rules, which field, which limit.

As in h11, the side matters: ``LocalProtocolError`` means we were about to send
something invalid (a bug or bad input in our process), ``RemoteProtocolError``
means the peer sent something invalid, ``PeerError`` is an error the peer
answered one of our requests with. Every error carries a short stable ``code``
for programs, the ``field`` and ``limit`` it broke (or None) and a message for
people, and travels over the wire as a small msgpack-able dict.
"""

from __future__ import annotations

from typing import Any, Self

#: The codes this layer raises; higher layers may answer with codes of their own.
CODES = frozenset(
    {
        "bad_magic",  # the bytes are not a delaymq frame or record
        "unknown_version",  # a frame or record version we do not speak
        "oversize",  # a frame or record larger than the limit
        "truncated",  # the bytes stop inside a frame or record
        "bad_crc",  # a record whose CRC does not check
        "bad_metadata",  # frame metadata that is not a msgpack map
        "bad_frame",  # a frame header field out of range (kind, ids)
        "bad_record",  # a record whose kind, flags or lengths do not add up
        "bad_value",  # a field with invalid content (UTF-8, control chars, types)
        "limit",  # a field longer (or shorter) than its limit allows
        "bad_request",  # a well-formed request the peer cannot serve
        "unauthorized",  # no token, or one the server does not know (delaymq.net.auth)
        "forbidden",  # a known token without the role or subject the request needs
        "rate_limited",  # a token over its messages_per_s or bytes_per_s: retry after retry_after_ms
    }
)

Limit = int | str | None


class ProtocolError(Exception):
    """A frame or record that breaks the protocol.

    ``fatal`` says the byte stream can no longer be trusted (close the
    connection); a non-fatal error leaves the stream in sync, and then
    ``request_id`` and ``command`` (when the frame header was readable) let a
    server answer the offending request with an error frame. ``index`` is the
    position of the offending record in a batch. ``retry_after_ms`` is the
    least wait before the same request may succeed (a rate limit), or None.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str,
        field: str | None = None,
        limit: Limit = None,
        index: int | None = None,
        fatal: bool = False,
        request_id: int | None = None,
        command: int | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.field = field
        self.limit = limit
        self.index = index
        self.fatal = fatal
        self.request_id = request_id
        self.command = command
        self.retry_after_ms = retry_after_ms

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only arguments: the default pickling would lose them.
        return (_rebuild, (type(self), self.message, self._attributes()))

    def _attributes(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "field": self.field,
            "limit": self.limit,
            "index": self.index,
            "fatal": self.fatal,
            "request_id": self.request_id,
            "command": self.command,
            "retry_after_ms": self.retry_after_ms,
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.message!r}, code={self.code!r}, field={self.field!r}, limit={self.limit!r})"
        )

    def to_dict(self) -> dict[str, Any]:
        """The error as a msgpack-able map, for the metadata of an error frame."""
        data: dict[str, Any] = {
            "code": self.code,
            "message": self.message,
            "field": self.field,
            "limit": self.limit,
        }
        if self.index is not None:
            data["index"] = self.index
        if self.retry_after_ms is not None:
            data["retry_after_ms"] = self.retry_after_ms
        return data

    @classmethod
    def from_dict(cls, data: Any) -> Self:
        """Rebuild an error from ``to_dict()``'s map, as received from a peer.

        A map that is not shaped like one raises ``RemoteProtocolError``: it
        came over the wire, so its shape is the peer's fault.
        """
        if not isinstance(data, dict):
            raise RemoteProtocolError(
                f"error is of type {type(data).__name__}, not a map",
                code="bad_metadata",
                field="error",
            )
        code = data.get("code")
        message = data.get("message", "")
        field = data.get("field")
        limit = data.get("limit")
        index = data.get("index")
        retry_after_ms = data.get("retry_after_ms")
        for name, ok, wanted in (
            ("code", isinstance(code, str) and code, "a non-empty string"),
            ("message", isinstance(message, str), "a string"),
            ("field", field is None or isinstance(field, str), "a string"),
            ("limit", limit is None or _is_int(limit) or isinstance(limit, str), "an int or str"),
            ("index", index is None or _is_int(index), "an int"),
            ("retry_after_ms", retry_after_ms is None or _is_int(retry_after_ms), "an int"),
        ):
            if not ok:
                raise RemoteProtocolError(f"error {name!r} is not {wanted}", code="bad_metadata", field=f"error.{name}")
        return cls(
            str(message or code), code=str(code), field=field, limit=limit, index=index, retry_after_ms=retry_after_ms
        )


class LocalProtocolError(ProtocolError):
    """We were about to send something invalid (e.g. a subject over the limit)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something invalid."""


class PeerError(ProtocolError):
    """An error the peer answered our request with; code, field and limit are its words."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _rebuild(cls: type[ProtocolError], message: str, attributes: dict[str, Any]) -> ProtocolError:
    return cls(message, **attributes)


def sole(error: BaseException) -> BaseException:
    """The one exception inside nested one-member groups (a trio nursery wraps what crosses it), else ``error``."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


__all__ = ["sole", "CODES", "LocalProtocolError", "PeerError", "ProtocolError", "RemoteProtocolError"]
