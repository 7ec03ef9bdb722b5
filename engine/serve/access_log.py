"""The server's access log: one line per answer, buffered and written in blocks; never a request body."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


class AccessLog:
    """Buffered access log: lines are kept in memory and written in blocks; never a request body."""

    def __init__(self, stream: TextIO | None, *, flush_lines: int = 64, flush_s: float = 1.0):
        self._stream = stream
        self._flush_lines = flush_lines
        self._flush_s = flush_s
        self._lines: list[str] = []
        self._last_flush = time.monotonic()
        self._lock = threading.Lock()

    def write(self, line: str) -> None:
        if self._stream is None:
            return
        with self._lock:
            self._lines.append(line)
            if len(self._lines) >= self._flush_lines or time.monotonic() - self._last_flush >= self._flush_s:
                self._flush_locked()

    def request(self, client: str, request_line: str, status: int, size: int, elapsed_s: float | None) -> None:
        """One request's line: `client - [date] "request line" status bytes ms`."""
        if self._stream is None:
            return
        elapsed = f" {1e3 * elapsed_s:.2f}ms" if elapsed_s is not None else ""
        when = time.strftime("%d/%b/%Y %H:%M:%S")
        self.write(f'{client} - [{when}] "{request_line}" {status} {size}{elapsed}')

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def alert(self, line: str) -> None:
        """Write `line` at once, after what is buffered: to the log's stream, or to stderr when the log is off."""
        with self._lock:
            self._flush_locked()
            stream = self._stream if self._stream is not None else sys.stderr
            stream.write(line + "\n")
            stream.flush()

    def _flush_locked(self) -> None:
        if self._lines and self._stream is not None:
            self._stream.write("\n".join(self._lines) + "\n")
            self._stream.flush()
        self._lines.clear()
        self._last_flush = time.monotonic()
