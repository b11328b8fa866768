"""Connection guards in uvicorn's HTTP/1.1 protocol: a deadline for request headers and a cap on
the connections one client address holds.

::

    connection_made ─► the peer holds max_per_client already? ─► 503 + Retry-After, closed
                    └► start the header timer ─► no complete request head in time ─► closed
    data_received   ─► a request head arrived: stop the timer; the first bytes of the next
                       request on a keep-alive connection start it again
    connection_lost ─► the peer's count goes down

uvicorn takes the protocol class as ``uvicorn.Config(http=...)``; :func:`guarded_protocol` makes
one per server, which holds that server's counts. It also sets TCP_NODELAY, which asyncio leaves
off when the listening socket was made without an explicit protocol (``socket.socket()``, as the
tests hand uvicorn): without it a keep-alive response's body waits ~40 ms for the client's
delayed ACK of its headers.

Between requests an idle keep-alive connection is uvicorn's own ``timeout_keep_alive`` business;
a request whose head arrived is not timed here (its body counts against ``max_request_bytes``).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter
from dataclasses import dataclass, field

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass
class ConnectionLimits:
    """One server's limits and its open connections per client host."""

    header_timeout: float
    """Seconds from connecting (or a keep-alive request's first byte) to a complete request head."""
    max_per_client: int
    """Open connections one client host may hold; 0: unlimited."""
    retry_after: int
    """Seconds suggested in the 503 that refuses a connection over the cap."""
    open: Counter[str] = field(default_factory=Counter)

    def refusal(self) -> bytes:
        """The whole HTTP response that refuses a connection over the cap."""
        body = json.dumps({"error": {
            "message": f"this client already holds {self.max_per_client} connections to the server; "
                       "reuse them (keep-alive) or close some", "type": "service_unavailable_error",
            "param": None, "code": "too_many_connections"}}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nretry-after: {self.retry_after}\r\nconnection: close\r\n\r\n")
        return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with :class:`ConnectionLimits` enforced; build with :func:`guarded_protocol`."""

    limits: ConnectionLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._header_timer: asyncio.TimerHandle | None = None
        self._host = self.client[0] if self.client else None
        self._counted = False
        limits = self.limits
        if self._host is not None and limits.max_per_client and limits.open[self._host] >= limits.max_per_client:
            transport.write(limits.refusal())
            transport.close()
            return
        if self._host is not None:
            limits.open[self._host] += 1
            self._counted = True
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # refused, or timed out: read nothing more
            return
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # no complete request head yet (a keep-alive one starts here)
            self._start_header_timer()
        else:
            self._stop_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if self._counted:
            self._counted = False
            self.limits.open[self._host] -= 1
            if self.limits.open[self._host] <= 0:
                del self.limits.open[self._host]
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.limits.header_timeout, self._header_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection from %s: no request head within %.1f s", self._host,
                             self.limits.header_timeout)
            self.transport.close()


def guarded_protocol(header_timeout: float, max_per_client: int, retry_after: int) -> type[GuardedH11Protocol]:
    """A protocol class for one server (its own counts), to pass as ``uvicorn.Config(http=...)``."""
    limits = ConnectionLimits(header_timeout, max_per_client, retry_after)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})
