"""What a server answers to each request before and around its handler: the token it acts as
(AUTH), whether that token may send it and what it takes from the token's rates, the handler's
reply or the error frame that says why not (counted by code, and logged once a minute a kind)."""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping

import trio

from delaymq.net.admission import (
    RefusalLog,
)
from delaymq.net.auth import (
    UNAUTHORIZED,
    AuthRefusal,
    Identity,
    TokenFile,
    TokenTable,
)
from delaymq.net.ratelimit import RateLimiter
from delaymq.net.requests import (
    RATED_COMMANDS,
    Handler,
    Request,
    batch_messages,
    request_scope,
)
from delaymq.protocol.commands import Command, command_name
from delaymq.protocol.errors import (
    ProtocolError,
    RemoteProtocolError,
)
from delaymq.protocol.frames import (
    Frame,
    FrameKind,
    error_response,
    response_to,
)

log = logging.getLogger("delaymq.net.server")


class RequestAnswerer:
    """Answers one request frame: token checks and rates first, then the command's handler."""

    def __init__(self, handlers: Mapping[int, Handler], *, tokens: TokenFile | None, refusal_log: RefusalLog) -> None:
        self.handlers = dict(handlers)
        self._tokens = tokens
        self._refusal_log = refusal_log
        self._rates = RateLimiter()
        self._rated_table: TokenTable | None = None  # the token table the rate limiter last saw
        self.errors_answered = 0
        self.refused: Counter[str] = Counter()

    def error_answered(self, code: str) -> None:
        self.errors_answered += 1
        self.refused[code] += 1

    def authenticate(self, frame: Frame, peer: str) -> tuple[Frame, str | None]:
        """Answer an AUTH request: the answer, and the token the connection is to remember (None: refused)."""
        token = frame.metadata.get("token") if isinstance(frame.metadata, dict) else None
        if not isinstance(token, str) or not token:
            error = RemoteProtocolError(
                "AUTH: field 'token' must be a non-empty string", code="bad_request", field="token"
            )
            self.error_answered("bad_request")
            return error_response(frame, error), None
        tokens = self._tokens
        if tokens is None:
            return response_to(frame, {"name": None}), token  # no tokens file: every request is served
        identity = tokens.table.identify(token)
        if identity is None:
            self.error_answered(UNAUTHORIZED)
            count = self._refusal_log.note("AUTH:unauthorized", trio.current_time())
            if count is not None:
                log.warning(
                    "refused a token from %s: unknown (%d such refusal(s) since the last such line)", peer, count
                )
            refusal = AuthRefusal(
                UNAUTHORIZED, "AUTH: unknown token: this server's tokens file does not hold it", "token"
            )
            return error_response(frame, refusal.error()), None
        return response_to(frame, {"name": identity.name}), token

    def _authorize(self, tokens: TokenFile, frame: Frame, token: str | None) -> tuple[Identity, dict[str, int] | None]:
        """The identity the request acts as, and what it took from its rates (None: nothing);
        ``RemoteProtocolError`` when the token may not send it, ``ProtocolError`` (``rate_limited``, or
        ``limit`` for a batch over a second's worth) past its rates.

        A known token's request is taken from ``requests_per_s`` first, before its scope is read (a
        SEND's records) or decided: a refused request is work too, and floods of them are rated."""
        table = tokens.table
        identity = table.identify(token)
        if identity is not None and "requests_per_s" in identity.rates:
            self._take_rates(table, identity, frame, {"requests_per_s": 1})
        checked = table.check(token, frame.command, request_scope(frame))
        if isinstance(checked, AuthRefusal):
            raise checked.error()
        if not checked.rates.keys() - {"requests_per_s"} or frame.command not in RATED_COMMANDS:
            return checked, None
        amounts = {"messages_per_s": batch_messages(frame), "bytes_per_s": len(frame.body)}
        self._take_rates(table, checked, frame, amounts)
        return checked, amounts

    def _take_rates(self, table: TokenTable, identity: Identity, frame: Frame, amounts: dict[str, int]) -> None:
        """Take ``amounts`` from the token's buckets of those rates, or refuse the request (nothing taken)."""
        if table is not self._rated_table:  # reloaded: a token removed takes its buckets with it
            self._rates.forget(table.names())
            self._rated_table = table
        rates = {name: rate for name, rate in identity.rates.items() if name in amounts}
        now_ms = math.floor(trio.current_time() * 1000)
        refusal = self._rates.check(identity.name, rates, amounts, now_ms, command=command_name(frame.command))
        if refusal is not None:
            raise refusal.error()

    async def answer(self, frame: Frame, peer: str, token: str | None = None, connection: int = 0) -> Frame | None:
        expects_answer = frame.kind == FrameKind.REQUEST
        if frame.kind == FrameKind.RESPONSE:
            error = RemoteProtocolError(
                f"a response frame ({command_name(frame.command)}) sent to a server",
                code="bad_frame",
                field="kind",
            )
            self.error_answered("bad_frame")
            return error_response(frame, error)
        handler = self.handlers.get(frame.command)
        tokens = self._tokens
        identity: Identity | None = None
        taken: dict[str, int] | None = None
        try:
            if tokens is not None:  # before anything else: a refused request changes nothing
                identity, taken = self._authorize(tokens, frame, token)
            if handler is None and frame.command == Command.PING:
                # Every server answers PING: a client probes a busy connection it hears nothing on.
                return response_to(frame) if expects_answer else None
            if handler is None:
                known = ", ".join(command_name(code) for code in sorted(self.handlers))
                raise RemoteProtocolError(
                    f"unknown command {command_name(frame.command)} (this server serves {known})",
                    code="bad_request",
                    field="command",
                )
            reply = await handler(Request(frame, peer, identity, connection))
        except ProtocolError as error:
            if taken is not None and identity is not None:  # a refused batch stores nothing: its messages
                # are not charged (the request itself counts against requests_per_s all the same)
                self._rates.give_back(identity.name, taken, math.floor(trio.current_time() * 1000))
            self.error_answered(error.code)
            # A flood of one refusal (a full disk refuses every SEND) is a line a minute with a count.
            count = self._refusal_log.note(f"{frame.command}:{error.code}", trio.current_time())
            if count is not None:
                log.info(
                    "refused %s from %s: %s (%d such refusal(s) since the last such line)",
                    command_name(frame.command), peer, error, count,
                )  # fmt: skip
            return error_response(frame, error) if expects_answer else None
        except Exception as error:  # a bug in a handler must not kill the server
            self.error_answered("internal")
            log.exception("%s from %s failed", command_name(frame.command), peer)
            internal = RemoteProtocolError(f"internal error: {type(error).__name__}: {error}", code="internal")
            return error_response(frame, internal) if expects_answer else None
        if not expects_answer:
            return None
        if reply is None:
            return response_to(frame)
        if isinstance(reply, tuple):
            return response_to(frame, reply[0], reply[1])
        return response_to(frame, reply)
