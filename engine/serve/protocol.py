"""The HTTP/1.1 protocol: uvicorn's httptools protocol with the framing answers uvicorn does not give.

Framing the contract does not name, each a JSON answer on a closed connection: 400 a Content-Length that is not one
decimal number (or two that differ), a bad chunk, a Transfer-Encoding other than one `chunked` (two fields included), a
request target that does not parse; 413 a chunk whose declared size takes the body over 4 MiB, as soon as its size line
is read; 431 a head over 64 KiB or over 100 fields; 501 a method the parser does not know; 505 HTTP/2 or a later version
(a request line without one: 400); 408 a head not complete 30 s after its first byte,
or a declared body not complete 30 s after the head. These come from `DecisionProtocol`, uvicorn's httptools protocol
with these answers (a replica manager that runs its own uvicorn answers the parser's refusals with uvicorn's plain-text
400). A request with both Content-Length and chunked is read as chunked and answered on a closed connection (RFC 9112
§6.3). A connection idle for 30 s (before its first request or between requests) is closed. An answer given before the
body was read (403, 415, 413, 408 ...) closes the connection after reading and dropping what the client still sends (at
most 8 MiB, 2 s), so the client reads the answer instead of a connection reset. Pipelined requests before a refused one
are answered first, in order, then the refusal (reading stops meanwhile). The server keeps serving after every one of
these.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from engine.serve.app import ANSWER_HEADERS, MAX_BODY_BYTES, DecisionApp, json_bytes, request_line

IDLE_TIMEOUT_S = 30.0  # a connection without a request in progress (the contract's socket timeout)
HEAD_TIMEOUT_S = 30.0  # from a request's first byte to the end of its head
MAX_HEAD_BYTES = 64 * 1024
MAX_HEADER_FIELDS = 100
CHUNK_LINE_BYTES = 4096  # bytes kept to read a chunk's size line (a longer line, extensions included, is not read)


class _Refused(Exception):
    """Raised from a parser callback to stop parsing a request the protocol refuses."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class DecisionProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with what uvicorn 0.54 and Starlette cannot do, each with the test that needs it:

    * a JSON answer with the right status for what the parser refuses: uvicorn answers every `HttpParserError` with a
      plain-text "Invalid HTTP request received." 400 (`_framing_refusal`; test_server_stack.py
      `test_fuzz_findings_get_the_contract_answers`, `test_oversize_heads_are_431`);
    * a bound on the head: uvicorn's httptools protocol has none on bytes or fields (h11's incomplete-event size is
      the other parser's) and no head timeout (`test_oversize_heads_are_431`, `test_slow_heads_and_bodies_are_408`);
    * an idle connection closed `IDLE_TIMEOUT_S` after it opened: uvicorn starts its keep-alive timer only after a
      first answer, so a connection that never sends would stay open for good (`connection_made`; no test waits the
      30 s: test_server_stack.py `test_idle_connections_cost_no_thread` and the fuzz tool's `idle` section hold such
      connections open);
    * pipelined requests before a refused one answered first: uvicorn answers the refusal at once, in the place of the
      earlier answers (`_refuse`, `on_response_complete`;
      `test_pipelined_requests_before_a_refused_one_are_answered_first`);
    * the running cycle told of a lost connection: uvicorn marks only the latest cycle (`connection_lost`; the running
      forward then stops: test_server_abuse.py `test_a_closed_connection_stops_the_forward`);
    * 505 for HTTP/2 and later, which httptools accepts and uvicorn answers as 1.1, and 400 for a request line
      without a version (`on_headers_complete`; test_server_abuse.py `test_an_http_2_request_line_is_505`);
    * 413 for a chunk declared past the body limit as soon as its size line is read: httptools does not expose the
      size, so it is read from the bytes received (`_open_chunk_size`;
      `test_a_chunk_over_the_body_limit_is_413_at_once`);
    * both framings read as chunked (httptools' `lenient_chunked_length`; the app answers on a closed connection:
      test_server.py `test_chunked_bodies`), and the access log and metrics of every refusal.
    """

    def __init__(self, *args: Any, decisions: DecisionApp, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.parser.set_dangerous_leniencies(lenient_chunked_length=True)
        self.decisions = decisions
        self._in_head = False
        self._head_bytes = 0  # bytes received while the head is unfinished
        self._head_parsed = 0  # bytes of the target and fields the parser has read
        self._head_fields = 0
        self._head_timer: asyncio.TimerHandle | None = None
        self._running: Any = None  # the request cycle whose app runs (or ran last); pipelined ones wait behind it
        self._refusal: tuple[int, str, bool] | None = None  # a refusal waiting for the answers before it
        self._began_in_feed = False  # a request began in the bytes being parsed now
        self._body_bytes = 0  # body bytes of the request being read
        self._chunk_body = 0  # body bytes of its open chunk since the chunk's size line
        self._chunk_open = False
        self._chunk_started_in_feed = False  # a chunk header was parsed in the bytes being parsed now
        self._tail = b""  # the last CHUNK_LINE_BYTES bytes received before the ones being parsed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        running = self._running
        if running is not None and running is not self.cycle and not running.response_complete:
            running.disconnected = True  # uvicorn marks only the latest cycle; the running one must not write either
            running.message_event.set()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # the connection closes after the answers before the refused request
        self._unset_keepalive_if_required()
        self._began_in_feed = self._chunk_started_in_feed = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # no protocol upgrades: the request is answered as plain HTTP
        except httptools.HttpParserError as error:
            self._refuse(*_framing_refusal(error))
            return
        finally:
            tail, self._tail = self._tail, (self._tail + data)[-CHUNK_LINE_BYTES:]
        # A read that holds a head's beginning may hold the end of the request before it (a pipelined body): its head
        # bytes are counted as the parser reports them (`_count_head`); every later read of an unfinished head belongs
        # to it whole (one field may be growing without end, reported only at its end). So a head is refused at most
        # one read (asyncio reads up to 256 KiB) past MAX_HEAD_BYTES.
        if self._in_head and not self._began_in_feed:
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"request head over {MAX_HEAD_BYTES} bytes")
        elif self._chunk_open and self._chunk_started_in_feed:
            declared = _open_chunk_size(tail + data, self._chunk_body)
            if declared is not None and self._body_bytes - self._chunk_body + declared > MAX_BODY_BYTES:
                self._refuse(413, "request body size is outside server limits")

    def on_chunk_header(self) -> None:
        self._chunk_open = self._chunk_started_in_feed = True
        self._chunk_body = 0

    def on_chunk_complete(self) -> None:
        self._chunk_open = False

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self._chunk_body += len(body)
        super().on_body(body)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = self._began_in_feed = True
        self._body_bytes = 0
        self._chunk_open = False
        self._head_bytes = 0
        self._head_parsed = 0
        self._head_fields = 0
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        if self._head_fields > MAX_HEADER_FIELDS:
            raise _Refused(431, f"request head over {MAX_HEADER_FIELDS} header fields")
        self._count_head(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        """A head that arrives in one piece is counted as the parser reads it (target and fields)."""
        self._head_parsed += size
        if self._head_parsed > MAX_HEAD_BYTES:
            raise _Refused(431, f"request head over {MAX_HEAD_BYTES} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._stop_head_timer()
        version = self.parser.get_http_version()
        if version == "0.9":  # what httptools reports for a request line without a version
            raise _Refused(400, "invalid request line: no HTTP version")
        if not version.startswith("1."):  # httptools accepts 2.0 and 3.0 besides 0.9, 1.0 and 1.1
            raise _Refused(505, f"HTTP version not supported: HTTP/{version} (this server speaks HTTP/1.1 and 1.0)")
        super().on_headers_complete()

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, f"the request head was not complete within {HEAD_TIMEOUT_S:g} s")

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request the parser refused, unless its answer has begun, and close the connection. Pipelined
        requests before it are answered first, in order (reading stops meanwhile): the refusal is the answer to the
        request it refuses, never to an earlier one."""
        self._in_head = False
        self._stop_head_timer()
        if self._refusal is not None:  # already refused: waiting for the earlier answers
            return
        cycle = self.cycle if self.cycle is not None and not self.cycle.response_complete else None
        if cycle is not None and not cycle.more_body:
            cycle = None  # that request is complete: the refused one is the next, whose head did not parse
        queued = [entry for entry in self.pipeline if entry[0] is cycle]
        for entry in queued:  # the refused request was waiting behind others: it never runs
            self.pipeline.remove(entry)
        if cycle is not None and not queued:
            cycle.disconnected = True  # the app, if it runs, reads a disconnect and its answer goes nowhere
            cycle.message_event.set()
        logged = cycle is None or bool(queued)  # else the app, reading the disconnect, logs and counts the request
        running = self._running is not None and not self._running.response_complete and self._running is not cycle
        if self.pipeline or running:
            self._refusal = (status, message, logged)
            self.flow.pause_reading()
            return
        self._send_refusal(status, message, logged, started=cycle is not None and cycle.response_started)

    def _send_refusal(self, status: int, message: str, logged: bool, *, started: bool = False) -> None:
        if not self.transport.is_closing() and not started:
            payload = json_bytes({"error": message})
            head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
            head += [name + b": " + value for name, value in self.server_state.default_headers]
            head += [b"content-type: application/json", b"content-length: %d" % len(payload)]
            head += [name + b": " + value for name, value in ANSWER_HEADERS] + [b"connection: close"]
            self.transport.write(b"\r\n".join(head) + b"\r\n\r\n" + payload)
            if logged:
                line = request_line(self.scope) if self.scope and "path" in self.scope else "-"
                self.decisions.answered(self.client[0] if self.client else "-", line, status, len(payload), None)
        self.transport.close()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._running = cycle
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        """As uvicorn's, but with a refusal waiting: start the next earlier request, or after the last one answer the
        refusal, and read nothing more."""
        if self._refusal is None:
            return super().on_response_complete()
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        if self.pipeline:
            self._start_asgi_task(*self.pipeline.pop())
        else:
            self._send_refusal(*self._refusal)


def _open_chunk_size(received: bytes, chunk_body: int) -> int | None:
    """The declared size of the chunk being read, from the bytes `received` up to now, which end with its size line
    and then the `chunk_body` bytes of it the parser delivered; None when the line is not all there or not hex."""
    line = received[: len(received) - chunk_body].rstrip(b"\r\n")
    start = max(line.rfind(b"\n"), line.rfind(b"\r")) + 1
    if start == 0 and len(received) >= CHUNK_LINE_BYTES:
        return None  # the line may have begun before what is kept
    size = line[start:].split(b";", 1)[0].strip()
    try:
        return int(size, 16)
    except ValueError:
        return None


def _framing_refusal(error: httptools.HttpParserError) -> tuple[int, str]:
    """The answer to what httptools refused (its messages are llhttp's)."""
    cause = error.__context__
    if isinstance(cause, _Refused):
        return cause.status, cause.message
    if isinstance(error, httptools.HttpParserInvalidMethodError):
        return 501, "unsupported method"
    if isinstance(cause, httptools.HttpParserInvalidURLError):
        return 400, "invalid request target"
    text = str(error)
    if "Content-Length" in text:
        return 400, "invalid Content-Length"
    if "Transfer-Encoding" in text:
        return 400, "unsupported Transfer-Encoding"
    if "chunk" in text.lower():
        return 400, "invalid chunked body"
    return 400, f"malformed request: {text}"
