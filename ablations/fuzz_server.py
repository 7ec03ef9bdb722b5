"""A fuzz campaign against the decision server over raw sockets, idle connections, and the amplification bodies.

    python -m ablations.fuzz_server [--cases N] [--seed S] [--shapes tiny|qwen3.8-27b] [--backend STAGE]
                                    [--body-timeout S] [--idle N] [--out results/server/fuzz.json]

Three sections, each against its own in-process `DecisionServer` on a free loopback port:

* `campaign`: `--cases` seeded malformed requests (and one valid control after every ten) sent one at a time, each on
  a new connection, drawn evenly from the families of `FAMILIES`: mutated JSON bodies, broken framing, bad request
  lines and targets, header abuse, slow clients, pipelined requests. The model is `overhead_model` (no forward, so an
  answer takes about a millisecond) or, with `--backend`, that stage over the tiny twin. The server's body timeout
  and head timeout are `--body-timeout` (default 1 s; the head timeout is `engine.server.HEAD_TIMEOUT_S`, set for the
  campaign and restored after), so that requests never finished are answered 408 within the campaign's time. Each
  case records its family, its kind, the status of every answer (or `closed` without one, `reset`, `timeout`) and
  its time, and is classified; a finding is any of
  `crash` (the server thread died or `GET /health` on a new connection is not 200 after the case),
  `server_error` (a 5xx answer: 503 and 504 are justified only by a full queue or a passed deadline, which these
  requests never cause, and 501 only for a method other than GET, HEAD and POST),
  `hang` (neither an answer nor a close within `--body-timeout` + 2 s of the last byte sent),
  `malformed` (bytes that do not parse as HTTP/1.1 responses, a body on a HEAD answer, a body that is not a JSON
  object where the contract promises JSON: every answer but `/metrics` and the 302),
  `unanswered` (the connection closed or was reset before every request sent had its answer, although no answer so
  far said `connection: close`), and
  `control` (a valid control not 200 or its answer, less `metadata.inference_seconds`, not the first control's).
  Findings carry the raw request bytes (repr, truncated to 600 characters).

* `idle`: `--idle` connections (half send nothing, half send an unfinished head) held open at once while one client
  times 50 ordinary requests (a short decision request on a new connection each), against the same 50 without them;
  with the process's thread count (`threading.active_count` and `/proc/self/status` Threads) before and after, and the
  open-file limit (the soft limit is raised to the hard limit when the connections need more; the record says so).
  Targets: no thread per connection, P50 delayed by less than 50 ms. This server keeps the default 30 s timeouts.

* `amplification`: issue 15's bodies (`ablations.amplification`) to a server over the tiny twin `DecisionModel`
  (`hf_torch`, synthetic weights): time to the 422 and the process's resident-memory growth while the server handles
  it, sampled from `/proc/self/status` VmRSS by a thread every 1 ms (the peak over the request minus the value just
  before it), while a second client sends short requests whose latency during the big request is compared with its
  latency before. Targets: refused in < 0.5 s, peak growth < 100 MB, short requests at their usual latency.

The record (`--out`, default `results/server/fuzz.json`) holds the environment, the configuration, the counts per
family, kind and status, the findings, and the two measurements; a short table is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import re
import resource
import socket
import sys
import threading
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import engine.server
from ablations import envinfo
from ablations.amplification import amplification_body, many_candidates_body
from ablations.overhead import latency_stats, overhead_model
from engine.server import DecisionServer, build_decision_model
from reference.shapes import SHAPES, TINY

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "results" / "server" / "fuzz.json"
FINDING_CLASSES = ("crash", "server_error", "hang", "malformed", "unanswered", "mismatch", "control")
FAMILIES = ("json_body", "framing", "request_line", "headers", "slow", "pipelined")
CONTROL_EVERY = 10  # one valid control after every this many fuzz cases
HANG_MARGIN_S = 2.0  # a hang: no answer and no close within the body timeout plus this, after the last byte
RAW_REPR_CHARS = 600
IDLE_DELAY_TARGET_MS = 50.0
AMPLIFICATION_TARGET_S = 0.5
AMPLIFICATION_TARGET_MB = 100.0
SMALL_PAUSE_S = 0.005  # between the small requests of the clients beside an amplification body
POST = "/v1/systemone"
HTTP_VERSION = re.compile(rb"HTTP/1\.1 ([1-5][0-9]{2}) [^\r\n]*")
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


# ---- requests -------------------------------------------------------------------------------------------------------


def short_request(index: int) -> dict:
    return {
        "state": f"Order {index} arrived {index + 2} days late.",
        "questions": {"late": {"type": "noul", "instructions": "Late?"}},
    }


def valid_request(rng: random.Random) -> dict:
    """A valid request of one to three questions (noul, choice, score)."""
    questions: dict[str, Any] = {}
    for index in range(rng.randint(1, 3)):
        kind = rng.choice(("noul", "choice", "score"))
        if kind == "noul":
            questions[f"q{index}"] = {"type": "noul", "instructions": "Is the customer upset?"}
        elif kind == "choice":
            options = {f"o{k}": f"option {k}" for k in range(rng.randint(2, 5))}
            questions[f"q{index}"] = {"type": "choice", "instructions": "Which one?", "criteria": options}
        else:
            questions[f"q{index}"] = {"type": "score", "instructions": "How late?", "criteria": ["no", "some", "very"]}
    return {"state": f"Order {rng.randint(0, 999)} arrived {rng.randint(1, 9)} days late.", "questions": questions}


def http_request(
    method: str = "POST",
    target: str = POST,
    body: bytes = b"",
    *,
    headers: list[tuple[str, str]] | None = None,
    extra: list[bytes] = (),
    version: str = "HTTP/1.1",
    length: bool = True,
) -> bytes:
    """Raw request bytes: the request line, `headers` (default Host and, for a POST, the JSON Content-Type), the raw
    `extra` field lines, a Content-Length when `length` (and the method sends a body), the body."""
    if headers is None:
        headers = [("Host", "localhost")]
        if method == "POST":
            headers.append(("Content-Type", "application/json"))
    lines = [f"{method} {target} {version}".encode("latin-1")]
    lines += [f"{name}: {value}".encode() for name, value in headers]
    lines += list(extra)
    if length and (body or method == "POST"):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, start = b"", 0
    for size in sizes:
        piece = body[start : start + size]
        if piece:
            out += b"%x\r\n%s\r\n" % (len(piece), piece)
        start += size
    if start < len(body):
        out += b"%x\r\n%s\r\n" % (len(body) - start, body[start:])
    return out + b"0\r\n\r\n"


def json_head(extra: list[bytes] = (), method: str = "POST", target: str = POST) -> bytes:
    lines = [f"{method} {target} HTTP/1.1".encode(), b"Host: localhost", b"Content-Type: application/json", *extra]
    return b"\r\n".join(lines) + b"\r\n\r\n"


@dataclass
class Case:
    """One fuzz case: `pieces` sent in order, each followed by its pause (s). `expect`: the answers to wait for (one
    per request sent; fewer when the server may close first). `heads`: per expected answer, whether it answers a
    HEAD. `methods_ok`: a 501 is justified (the method is not GET, HEAD or POST)."""

    family: str
    kind: str
    pieces: list[tuple[bytes, float]]
    expect: int = 1
    heads: list[bool] = field(default_factory=list)
    method_501_ok: bool = False
    json_exempt: bool = False  # /metrics: Prometheus text
    control: bool = False
    expected: list[int | None] = field(default_factory=list)  # pipelined: the status each answer must have

    @property
    def raw(self) -> bytes:
        return b"".join(piece for piece, _ in self.pieces)


def one(family: str, kind: str, raw: bytes, **options: Any) -> Case:
    return Case(family, kind, [(raw, 0.0)], **options)


def _replace_value(text: str, rng: random.Random, literal: str) -> str:
    """`text` (a JSON object) with one string value replaced by `literal`."""
    spots = [match.span() for match in re.finditer(r':\s*"[^"]*"', text)]
    if not spots:
        return text
    start, end = rng.choice(spots)
    return text[:start] + ": " + literal + text[end:]


def json_body_case(rng: random.Random) -> Case:
    """A POST whose JSON body was mutated (framing and headers valid)."""
    valid = json.dumps(valid_request(rng))
    kinds = {
        "byte_flip": lambda: _flip(valid.encode(), rng),
        "truncated": lambda: valid.encode()[: rng.randrange(len(valid))],
        "duplicate_key": lambda: ('{"state": "x", ' + valid[1:]).encode(),
        "nested_duplicate": lambda: valid.replace('"type":', '"type": "noul", "type":', 1).encode(),
        "nan_infinity": lambda: _replace_value(
            valid, rng, rng.choice(["NaN", "Infinity", "-Infinity", "-NaN"])
        ).encode(),
        "deep_nesting": lambda: _deep(rng),
        "huge_number": lambda: _replace_value(
            valid, rng, rng.choice(["1e400", "-1e400", "1e-400", "9" * 5000, "-" + "9" * 4301, "0." + "1" * 10000])
        ).encode(),
        "lone_surrogate": lambda: _replace_value(
            valid, rng, rng.choice(['"\\ud800"', '"\\udfff x"', '"a\\ud83d"'])
        ).encode(),
        "invalid_utf8": lambda: valid.encode().replace(
            b"late", rng.choice([b"l\xffte", b"l\xed\xa0\x80te", b"\xc0\xaf"]), 1
        ),
        "utf16": lambda: valid.encode(rng.choice(["utf-16", "utf-32", "utf-16-le"])),
        "bom": lambda: b"\xef\xbb\xbf" + valid.encode(),
        "wrong_type": lambda: _replace_value(
            valid, rng, rng.choice(["1", "[]", "null", "true", "{}", '{"a": [1, 2]}', "-0", "1.5"])
        ).encode(),
        "wrong_top": lambda: rng.choice([b"[]", b"null", b"1", b'"x"', b"{}", b'{"questions": {}}', b"true"]),
        "unknown_field": lambda: valid.replace("{", '{"zzz": {"a": 1}, ', rng.randint(1, 2)).encode(),
        "empty_or_blank": lambda: rng.choice([b"", b" ", b"\r\n", b"\x00", b"\t\n "]),
        "binary": lambda: bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))),
        "trailing_data": lambda: valid.encode() + rng.choice([b" {}", b"x", b"\x00", b",", b"\n\n]"]),
        "control_chars": lambda: valid.replace("late", "la\u0001\u001f\u007fte", 1).encode(),
        "escapes": lambda: valid.replace("late", "\\u0000\\uffff\\\\\\/\\x", 1).encode(),
        "many_keys": lambda: (
            '{"state": "s", "questions": {' + ", ".join(f'"k{i}": 1' for i in range(20000)) + "}}"
        ).encode(),
    }
    kind = rng.choice(sorted(kinds))
    return one("json_body", kind, http_request(body=kinds[kind]()))


def _flip(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def _deep(rng: random.Random) -> bytes:
    depth = rng.choice([100, 1000, 20000, 200000])
    opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
    nested = opener * depth + "1" + closer * depth
    return ('{"state": ' + nested + ', "questions": {"q": {"type": "noul", "instructions": "x"}}}').encode()


def framing_case(rng: random.Random) -> Case:
    """A POST of a valid body whose framing is broken."""
    body = json.dumps(valid_request(rng)).encode()
    head = json_head()
    n = len(body)

    def with_fields(*fields: bytes) -> bytes:
        return json_head(list(fields)) + body

    def te(*fields: bytes, data: bytes | None = None) -> bytes:
        return json_head(list(fields)) + (chunked(body, [7, 11]) if data is None else data)

    kinds: dict[str, Callable[[], bytes]] = {
        "cl_not_decimal": lambda: with_fields(
            b"Content-Length: " + rng.choice([b"abc", b"0x10", b"1e3", b"", b"12 34", b"\xff", str(n).encode() + b"a"])
        ),
        "cl_signed": lambda: with_fields(b"Content-Length: " + rng.choice([b"-1", b"+%d" % n, b"-%d" % n, b"-0"])),
        "cl_duplicate_same": lambda: with_fields(b"Content-Length: %d" % n, b"Content-Length: %d" % n),
        "cl_duplicate_differ": lambda: with_fields(b"Content-Length: %d" % n, b"Content-Length: %d" % (n + 1)),
        "cl_list": lambda: with_fields(b"Content-Length: %d, %d" % (n, n)),
        "cl_huge": lambda: with_fields(
            b"Content-Length: " + rng.choice([b"99999999999999999999", b"4194305", b"9" * 40])
        ),
        "cl_zero": lambda: with_fields(b"Content-Length: 0"),
        "cl_larger": lambda: with_fields(b"Content-Length: %d" % (n + rng.randint(1, 50))),
        "cl_smaller": lambda: with_fields(b"Content-Length: %d" % rng.randint(1, n - 1)),
        "cl_spaces": lambda: with_fields(b"Content-Length:   %d   " % n),
        "cl_and_te": lambda: te(b"Content-Length: %d" % n, b"Transfer-Encoding: chunked"),
        "te_twice": lambda: te(b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"),
        "te_list": lambda: te(
            b"Transfer-Encoding: " + rng.choice([b"gzip, chunked", b"chunked, chunked", b"identity"])
        ),
        "te_unknown": lambda: te(b"Transfer-Encoding: " + rng.choice([b"gzip", b"xchunked", b"chunked;q=1", b"\x00"])),
        "te_case": lambda: te(b"Transfer-Encoding: " + rng.choice([b"Chunked", b"CHUNKED", b" chunked "])),
        "chunk_size_bad": lambda: te(
            b"Transfer-Encoding: chunked",
            data=rng.choice([b"zz", b"-1", b"0x5", b"", b" 5", b"5 ", b"ffffffffffffffffff"])
            + b"\r\n"
            + body
            + b"\r\n0\r\n\r\n",
        ),
        "chunk_size_wrong": lambda: te(
            b"Transfer-Encoding: chunked", data=b"%x\r\n" % (n + rng.choice([-3, 3])) + body + b"\r\n0\r\n\r\n"
        ),
        "chunk_extension": lambda: te(
            b"Transfer-Encoding: chunked",
            data=b"%x;%s\r\n%s\r\n0\r\n\r\n" % (n, rng.choice([b"a=b", b"a", b'a="b c"', b"a=\x00", b";;"]), body),
        ),
        "missing_final_chunk": lambda: te(b"Transfer-Encoding: chunked", data=b"%x\r\n%s\r\n" % (n, body)),
        "trailers": lambda: te(
            b"Transfer-Encoding: chunked",
            data=b"%x\r\n%s\r\n0\r\nX-Trailer: 1\r\nContent-Length: 5\r\n\r\n" % (n, body),
        ),
        "chunk_no_crlf": lambda: te(b"Transfer-Encoding: chunked", data=b"%x\r\n%s0\r\n\r\n" % (n, body)),
        "bare_lf": lambda: head.replace(b"\r\n", b"\n") + b"Content-Length: %d\n\n" % n + body,
        "get_with_body": lambda: http_request("GET", "/health", b"hello", headers=[("Host", "localhost")]),
        "empty_chunked": lambda: te(b"Transfer-Encoding: chunked", data=b"0\r\n\r\n"),
    }
    kind = rng.choice(sorted(kinds))
    # A body longer than its Content-Length: the rest is parsed as the next request, whose "method" is body bytes
    return one("framing", kind, kinds[kind](), method_501_ok=kind == "cl_smaller")


METHODS_OTHER = ("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "BREW", "get", "PRI", "M-SEARCH", "PROPFIND")


def request_line_case(rng: random.Random) -> Case:
    body = json.dumps(short_request(rng.randint(0, 99))).encode()
    long_target = "/" + "a" * rng.choice([2000, 8000, 60000, 70000])
    kinds: dict[str, Callable[[], Case]] = {
        "unknown_method": lambda: one(
            "request_line", "unknown_method", http_request(rng.choice(METHODS_OTHER), "/health"), method_501_ok=True
        ),
        "unclosed_bracket": lambda: one(
            "request_line",
            "unclosed_bracket",
            http_request(rng.choice(["GET", "POST"]), rng.choice(["/[", "/v1/systemone[", "/[::1", "/a]["]), body),
        ),
        "absolute_uri": lambda: one(
            "request_line",
            "absolute_uri",
            http_request(
                rng.choice(["GET", "POST"]),
                rng.choice(
                    [
                        "http://localhost/health",
                        "http://[::1/x",
                        "http://evil.example/v1/systemone",
                        "https://localhost:1/",
                        "http://a@localhost/",
                    ]
                ),
                body,
            ),
        ),
        "odd_target": lambda: one(
            "request_line",
            "odd_target",
            http_request(
                rng.choice(["GET", "POST"]),
                rng.choice(
                    [
                        "*",
                        "//health",
                        "/health?x=1",
                        "/%00",
                        "/%ff%fe",
                        "/health#f",
                        "/./health",
                        "/health/..",
                        "health",
                        "/v1/systemone?a=b",
                    ]
                ),
                body,
            ),
        ),
        "long_target": lambda: one("request_line", "long_target", http_request("GET", long_target)),
        "version": lambda: one(
            "request_line",
            "version",
            http_request(
                rng.choice(["GET", "POST"]),
                rng.choice(["/health", POST]),
                body,
                version=rng.choice(
                    ["HTTP/0.9", "HTTP/1.0", "HTTP/2.0", "HTTP/1.2", "HTTP/9.9", "HTTX/1.1", "http/1.1", "HTTP/1.1 x"]
                ),
            ),
        ),
        "no_version": lambda: one("request_line", "no_version", b"GET /health\r\n\r\n"),
        "garbage_line": lambda: one(
            "request_line",
            "garbage_line",
            method_501_ok=True,
            raw=rng.choice(
                [
                    b"\x16\x03\x01\x02\x00\x01\x00",
                    b"hello\r\n\r\n",
                    b" GET / HTTP/1.1\r\n\r\n",
                    b"GET  /health  HTTP/1.1\r\nHost: localhost\r\n\r\n",
                    b"\r\n\r\n\r\nGET /he",
                    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
                ]
            ),
        ),
        "leading_crlf": lambda: one("request_line", "leading_crlf", b"\r\n\r\n" + http_request("GET", "/health")),
        "head_request": lambda: one(
            "request_line",
            "head_request",
            http_request(
                "HEAD",
                rng.choice(["/health", "/v1/models", "/nope", POST, "/", "/examples.json"]),
                extra=[b"Connection: close"],
            ),
            heads=[True],
        ),
        "get_routes": lambda: one(
            "request_line",
            "get_routes",
            http_request("GET", rng.choice(["/v1/models", "/", "/examples.json", "/nope", POST])),
        ),
        "metrics": lambda: one("request_line", "metrics", http_request("GET", "/metrics"), json_exempt=True),
        "post_other_path": lambda: one(
            "request_line",
            "post_other_path",
            http_request("POST", rng.choice(["/health", "/", "/v1/systemone/", "/V1/SYSTEMONE"]), body),
        ),
    }
    return kinds[rng.choice(sorted(kinds))]()


def headers_case(rng: random.Random, port: int) -> Case:
    body = json.dumps(short_request(rng.randint(0, 99))).encode()
    ctype = ("Content-Type", "application/json")

    def post(headers: list[tuple[str, str]], extra: list[bytes] = ()) -> bytes:
        return http_request("POST", POST, body, headers=headers, extra=list(extra))

    hosts = ["localhost", f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST"]
    kinds: dict[str, Callable[[], bytes]] = {
        "no_host": lambda: post([ctype]),
        "two_hosts": lambda: post([("Host", "localhost"), ("Host", rng.choice(["localhost", "evil.example"])), ctype]),
        "foreign_host": lambda: post(
            [
                (
                    "Host",
                    rng.choice(
                        [
                            "evil.example",
                            "localhost.evil.example",
                            "127.0.0.1.nip.io",
                            "0.0.0.0",
                            "[::2]",
                            "10.0.0.1:80",
                        ]
                    ),
                ),
                ctype,
            ]
        ),
        "bad_host": lambda: post(
            [
                (
                    "Host",
                    rng.choice(
                        [
                            "",
                            "localhost:abc",
                            "local host",
                            "a@localhost",
                            "localhost:99999999",
                            "[::1",
                            "localhost/x",
                            "localhost:8791:1",
                        ]
                    ),
                ),
                ctype,
            ]
        ),
        "origin": lambda: post(
            [
                ("Host", (host := rng.choice(hosts))),
                ctype,
                (
                    "Origin",
                    rng.choice(
                        [
                            f"http://{host}",
                            f"https://{host}",
                            "null",
                            "http://[::1",
                            f"http://{host}/",
                            f"http://{host}/x",
                            "http://evil.example",
                            "",
                            "file://",
                            f"HTTP://{host}",
                        ]
                    ),
                ),
            ]
        ),
        "content_type": lambda: post(
            [
                ("Host", "localhost"),
                (
                    "Content-Type",
                    rng.choice(
                        [
                            "text/plain",
                            "application/json; charset=utf-8",
                            "APPLICATION/JSON",
                            "application/jsonx",
                            "",
                            "application/json, text/plain",
                            "multipart/form-data; boundary=x",
                        ]
                    ),
                ),
            ]
        ),
        "no_content_type": lambda: post([("Host", "localhost")]),
        "oversize_field": lambda: post(
            [("Host", "localhost"), ctype, ("X-Big", "a" * rng.choice([8000, 60000, 70000]))]
        ),
        "many_fields": lambda: post(
            [("Host", "localhost"), ctype] + [(f"X-{i}", "1") for i in range(rng.choice([90, 101, 200]))]
        ),
        "obs_fold": lambda: post([("Host", "localhost"), ctype], [b"X-Folded: a", rng.choice([b" b", b"\tb", b"  "])]),
        "nul_byte": lambda: post(
            [("Host", "localhost"), ctype], [rng.choice([b"X-Nul: a\x00b", b"X-N\x00ul: a", b"Host\x00: localhost"])]
        ),
        "non_ascii": lambda: post(
            [("Host", "localhost"), ctype],
            [rng.choice(["X-U: caf\u00e9".encode(), b"X-L: caf\xe9", "X-\u00e9: 1".encode(), b"X-C: \x7f\x01"])],
        ),
        "no_colon": lambda: post(
            [("Host", "localhost"), ctype], [rng.choice([b"X-No-Colon", b": value", b"Host : localhost", b" X: 1"])]
        ),
        "expect_continue": lambda: post(
            [("Host", "localhost"), ctype, ("Expect", rng.choice(["100-continue", "200-ok"]))]
        ),
        "upgrade": lambda: post(
            [
                ("Host", "localhost"),
                ctype,
                ("Connection", "Upgrade"),
                ("Upgrade", rng.choice(["websocket", "h2c", "foo"])),
            ]
        ),
        "connection_values": lambda: post(
            [
                ("Host", "localhost"),
                ctype,
                ("Connection", rng.choice(["close", "keep-alive", "close, keep-alive", "Host", "\x01"])),
            ]
        ),
        "host_case_port": lambda: post(
            [("Host", rng.choice(["LocalHost:1", "127.0.0.1:", "[::1]", "[::1]:0"])), ctype]
        ),
    }
    kind = rng.choice(sorted(kinds))
    return one("headers", kind, kinds[kind]())


def slow_case(rng: random.Random) -> Case:
    """A request sent in pieces with short pauses, or never finished (the server's head or body timeout answers)."""
    body = json.dumps(valid_request(rng)).encode()
    raw = http_request(body=body)
    split = raw.index(b"\r\n\r\n") + 4
    kind = rng.choice(
        ["head_pieces", "body_pieces", "byte_by_byte_head", "head_never_finished", "body_never_finished",
         "chunks_slow", "chunks_never_finished", "invalid_slow"]
    )  # fmt: skip
    if kind == "head_pieces":
        cuts = sorted(rng.sample(range(1, split), 3))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    elif kind == "body_pieces":
        cuts = sorted(rng.sample(range(split + 1, len(raw)), 3))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    elif kind == "byte_by_byte_head":
        head = http_request("GET", "/health")
        return Case("slow", kind, [(head[i : i + 1], 0.001) for i in range(len(head))])
    elif kind == "head_never_finished":
        return Case("slow", kind, [(raw[: rng.randrange(1, split - 2)], 0.0)])
    elif kind == "body_never_finished":
        return Case("slow", kind, [(raw[: rng.randrange(split, len(raw))], 0.0)])
    elif kind == "chunks_slow":
        data = chunked(body, [5, 9, 13])
        head = json_head([b"Transfer-Encoding: chunked"])
        pieces = [head, *(data[i : i + 16] for i in range(0, len(data), 16))]
        return Case("slow", kind, [(piece, 0.02) for piece in pieces])
    elif kind == "chunks_never_finished":
        data = chunked(body, [5, 9])
        return Case("slow", kind, [(json_head([b"Transfer-Encoding: chunked"]) + data[: len(data) - 5], 0.0)])
    else:
        pieces = [raw[:split], body[: len(body) // 2], b"\x00garbage"]
        pieces[0] = pieces[0].replace(b"Content-Length: %d" % len(body), b"Content-Length: %d" % (len(body) // 2 + 8))
    return Case("slow", kind, [(piece, rng.uniform(0.02, 0.15)) for piece in pieces])


def pipelined_case(rng: random.Random) -> Case:
    """Two to five requests in one write (or two); all but the last keep the connection open, and their answers are
    known (a `mismatch` finding when an answer is not the one of its request)."""
    chunked_post = http_request(
        "POST", POST, headers=[("Host", "localhost"), ("Content-Type", "application/json")],
        extra=[b"Transfer-Encoding: chunked"], length=False,
    ) + chunked(json.dumps(short_request(1)).encode(), [4])  # fmt: skip
    keep: list[tuple[Callable[[], bytes], bool, int | None]] = [
        (lambda: http_request("GET", "/health"), False, 200),
        (lambda: http_request("GET", "/v1/models"), False, 200),
        (lambda: http_request("HEAD", "/health"), True, 200),
        (lambda: http_request("GET", "/nope"), False, 404),
        (lambda: http_request(body=json.dumps(valid_request(rng)).encode()), False, 200),
        (lambda: http_request(body=b'{"state": "s"}'), False, 422),  # a 422 keeps the connection
        (lambda: http_request(body=b"{"), False, 422),
        (lambda: chunked_post, False, 200),
    ]
    text_plain = http_request("POST", POST, b"{}", headers=[("Host", "localhost"), ("Content-Type", "text/plain")])
    last = [
        *keep,
        (lambda: text_plain, False, 415),
        (lambda: http_request("BREW", "/health"), False, 501),
        (lambda: b"GARBAGE\r\n\r\n", False, None),
        (lambda: http_request("GET", "/health", extra=[b"Connection: close"]), False, 200),
        (lambda: http_request("GET", "/health", extra=[b"X-Big: " + b"a" * 70000]), False, 431),
    ]
    count = rng.randint(2, 5)
    chosen = [rng.choice(keep) for _ in range(count - 1)] + [rng.choice(last)]
    raw = b"".join(make() for make, _, _ in chosen)
    pieces = [(raw, 0.0)]
    if rng.random() < 0.3:
        cut = rng.randrange(1, len(raw))
        pieces = [(raw[:cut], 0.01), (raw[cut:], 0.0)]
    return Case(
        "pipelined",
        f"{count}_requests",
        pieces,
        expect=count,
        heads=[head for _, head, _ in chosen],
        expected=[status for _, _, status in chosen],
        method_501_ok=True,
    )


def control_case(index: int) -> Case:
    return one("control", "valid", http_request(body=json.dumps(short_request(index % 3)).encode()), control=True)


def generate_cases(count: int, seed: int, port: int) -> list[Case]:
    """`count` fuzz cases, the families in turn (a seeded shuffle of each round), and a control after every ten."""
    rng = random.Random(seed)
    makers: dict[str, Callable[[], Case]] = {
        "json_body": lambda: json_body_case(rng),
        "framing": lambda: framing_case(rng),
        "request_line": lambda: request_line_case(rng),
        "headers": lambda: headers_case(rng, port),
        "slow": lambda: slow_case(rng),
        "pipelined": lambda: pipelined_case(rng),
    }
    cases: list[Case] = []
    made = 0
    while made < count:
        order = list(FAMILIES)
        rng.shuffle(order)
        for family in order[: count - made]:
            cases.append(makers[family]())
            made += 1
            if made % CONTROL_EVERY == 0:
                cases.append(control_case(made // CONTROL_EVERY))
    return cases


# ---- responses ------------------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, list[str]]
    body: bytes


class Malformed(Exception):
    pass


def parse_answers(data: bytes, heads: list[bool], closed: bool) -> tuple[list[Answer], bool]:
    """The complete HTTP/1.1 responses at the start of `data` (interim 1xx ones skipped), and whether bytes of an
    unfinished one follow. `heads[i]`: the i-th answer is to a HEAD (no body). Raises `Malformed`."""
    answers: list[Answer] = []
    pos = 0
    while pos < len(data):
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            if not (data[pos:].startswith(b"HTTP/1.1 ") or b"HTTP/1.1 ".startswith(data[pos:])):
                raise Malformed(f"bytes that do not start a response: {data[pos : pos + 40]!r}")
            if closed:
                raise Malformed("the connection closed inside a response head")
            return answers, True
        lines = data[pos:end].split(b"\r\n")
        status_line = HTTP_VERSION.fullmatch(lines[0])
        if status_line is None:
            raise Malformed(f"not a status line: {lines[0][:80]!r}")
        status = int(status_line.group(1))
        fields: dict[str, list[str]] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(b":")
            if not colon or not TOKEN.fullmatch(name):
                raise Malformed(f"not a header field: {line[:80]!r}")
            fields.setdefault(name.decode().lower(), []).append(value.strip().decode("latin-1"))
        start = end + 4
        if 100 <= status < 200:
            pos = start
            continue
        head = heads[len(answers)] if len(answers) < len(heads) else False
        lengths = fields.get("content-length", [])
        if "transfer-encoding" in fields:
            raise Malformed("a chunked answer (the server always sends Content-Length)")
        if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
            raise Malformed(f"Content-Length {lengths}")
        if head or status in (204, 304):
            size = 0
        elif lengths:
            size = int(lengths[0])
        else:
            raise Malformed(f"{status} without Content-Length")
        if len(data) < start + size:
            if closed:
                raise Malformed(f"the connection closed {start + size - len(data)} bytes short of the body")
            return answers, True
        answers.append(Answer(status, fields, data[start : start + size]))
        pos = start + size
    return answers, False


def check_json(answer: Answer, exempt: bool) -> str | None:
    if exempt or answer.status == 302:
        return None
    if answer.headers.get("content-type", [""])[0].split(";")[0] != "application/json":
        return f"{answer.status} with Content-Type {answer.headers.get('content-type')}"
    try:
        value = json.loads(answer.body)
    except ValueError:
        return f"{answer.status} with a body that is not JSON: {answer.body[:80]!r}"
    if not isinstance(value, (dict, list)):
        return f"{answer.status} with a JSON body that is not an object: {answer.body[:80]!r}"
    if answer.status >= 400 and not (isinstance(value, dict) and isinstance(value.get("error"), str)):
        return f"{answer.status} without an error message: {answer.body[:80]!r}"
    return None


def exchange(address: tuple[str, int], case: Case, bound_s: float) -> dict[str, Any]:
    """Send a case, read its answers: statuses, time, how the connection ended, and a malformation if any."""
    sock = socket.create_connection(address, timeout=bound_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    received = bytearray()
    ended = "open"
    start = time.perf_counter()
    try:
        for piece, pause in case.pieces:
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed early: read what it sent
            if pause:
                time.sleep(pause)
        last_sent = time.perf_counter()
        answers: list[Answer] = []
        malformed = None
        while True:
            try:
                answers, partial = parse_answers(bytes(received), case.heads, ended != "open")
            except Malformed as error:
                malformed = str(error)
                break
            said_close = bool(answers) and "close" in answers[-1].headers.get("connection", [""])[0].lower()
            if ended != "open" or (len(answers) >= case.expect and not said_close and not partial):
                break
            remaining = last_sent + bound_s - time.perf_counter()
            if remaining <= 0:
                ended = "timeout"
                break
            sock.settimeout(remaining)
            try:
                data = sock.recv(65536)
            except TimeoutError:
                ended = "timeout"
                break
            except ConnectionResetError:
                ended = "reset"
                continue
            if not data:
                ended = "closed"
                continue
            received += data
    finally:
        sock.close()
    return {
        "answers": answers,
        "ended": ended,
        "malformed": malformed,
        "seconds": time.perf_counter() - start,
        "after_last_byte_s": time.perf_counter() - last_sent,
    }


def without_timing(body: bytes) -> Any:
    value = json.loads(body)
    value.get("metadata", {}).pop("inference_seconds", None)
    return value


def health_ok(server: DecisionServer) -> bool:
    if server._serve_thread is None or not server._serve_thread.is_alive():
        return False
    try:
        with socket.create_connection(server.server_address, timeout=5.0) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        return data.startswith(b"HTTP/1.1 200 ")
    except OSError:
        return False


def classify(case: Case, result: dict[str, Any], alive: bool, reference: Any) -> list[str]:
    """The finding classes of one case (empty: none)."""
    found = []
    answers: list[Answer] = result["answers"]
    if not alive:
        found.append("crash")
    if result["malformed"] is not None:
        found.append("malformed")
    for answer in answers:
        if answer.status >= 500 and not (answer.status == 501 and case.method_501_ok):
            found.append("server_error")
            break
    for index, answer in enumerate(answers):
        if (case.heads[index] if index < len(case.heads) else False) or (
            problem := check_json(answer, case.json_exempt)
        ) is None:
            continue
        result["malformed"] = result["malformed"] or problem
        if "malformed" not in found:
            found.append("malformed")
    if result["ended"] == "timeout" and len(answers) < case.expect:
        found.append("hang")
    said_close = bool(answers) and "close" in answers[-1].headers.get("connection", [""])[0].lower()
    if result["ended"] in ("closed", "reset") and len(answers) < case.expect and not said_close:
        found.append("unanswered")
    if any(index < len(case.expected) and case.expected[index] not in (None, answer.status)
           for index, answer in enumerate(answers)):  # fmt: skip
        found.append("mismatch")
    if case.control:
        if len(answers) != 1 or answers[0].status != 200 or without_timing(answers[0].body) != reference:
            found.append("control")
    return found


def status_of(result: dict[str, Any], case: Case) -> str:
    """The status of the answer (`closed`, `reset`, `timeout` without one); pipelined: how many answered and the
    last answer's status."""
    answers = result["answers"]
    ended = result["ended"] if len(answers) < case.expect and result["ended"] != "open" else None
    if case.family == "pipelined":
        last = ended or (str(answers[-1].status) if answers else "none")
        return f"all answered, last {last}" if len(answers) == case.expect else f"{len(answers)} answered, then {last}"
    if answers:
        return "+".join(str(answer.status) for answer in answers)
    return ended or "none"


@contextlib.contextmanager
def head_timeout(seconds: float) -> Iterator[None]:
    saved = engine.server.HEAD_TIMEOUT_S
    engine.server.HEAD_TIMEOUT_S = seconds
    try:
        yield
    finally:
        engine.server.HEAD_TIMEOUT_S = saved


def campaign_model(shapes_name: str, backend: str | None) -> Any:
    if backend is None:
        return overhead_model(SHAPES[shapes_name])
    return build_decision_model(backend, TINY.name)


def run_campaign(cases_count: int, seed: int, *, model: Any, body_timeout_s: float = 1.0) -> dict[str, Any]:
    """The fuzz campaign (module docstring) against a fresh server of `model`."""
    bound_s = body_timeout_s + HANG_MARGIN_S
    with (
        head_timeout(body_timeout_s),
        DecisionServer(model, port=0, access_log=io.StringIO(), body_timeout_s=body_timeout_s) as server,
    ):
        server.start()
        address = server.server_address
        cases = generate_cases(cases_count, seed, address[1])
        reference = None
        rows = []
        findings = []
        started = time.perf_counter()
        for index, case in enumerate(cases):
            result = exchange(address, case, bound_s)
            alive = health_ok(server)
            if case.control and reference is None and result["answers"] and result["answers"][0].status == 200:
                reference = without_timing(result["answers"][0].body)
            found = classify(case, result, alive, reference)
            status = status_of(result, case)
            rows.append({"family": case.family, "kind": case.kind, "status": status, "seconds": result["seconds"]})
            if found:
                raw = repr(case.raw)
                findings.append(
                    {
                        "case": index,
                        "family": case.family,
                        "kind": case.kind,
                        "classes": found,
                        "status": status,
                        "detail": result["malformed"],
                        "seconds": round(result["seconds"], 4),
                        "request": raw
                        if len(raw) <= RAW_REPR_CHARS
                        else raw[:RAW_REPR_CHARS] + f"... ({len(case.raw)} bytes)",
                    }
                )
            if not alive:
                break
        elapsed = time.perf_counter() - started
        alive_at_end = health_ok(server)
    return summarize(rows, findings, elapsed, alive_at_end, seed, body_timeout_s)


def summarize(rows, findings, elapsed, alive_at_end, seed, body_timeout_s) -> dict[str, Any]:
    per_family: dict[str, dict[str, Any]] = {}
    for family in (*FAMILIES, "control"):
        mine = [row for row in rows if row["family"] == family]
        per_family[family] = {
            "cases": len(mine),
            "statuses": dict(sorted(Counter(row["status"] for row in mine).items())),
            "kinds": dict(sorted(Counter(row["kind"] for row in mine).items())),
            "seconds": latency_stats([row["seconds"] * 1000 for row in mine]),
        }
    classes = Counter(name for finding in findings for name in finding["classes"])
    return {
        "seed": seed,
        "body_timeout_s": body_timeout_s,
        "head_timeout_s": body_timeout_s,
        "hang_bound_s": body_timeout_s + HANG_MARGIN_S,
        "fuzz_cases": sum(1 for row in rows if row["family"] != "control"),
        "controls": per_family["control"]["cases"],
        "seconds": round(elapsed, 2),
        "alive_at_end": alive_at_end,
        "finding_counts": {name: classes.get(name, 0) for name in FINDING_CLASSES},
        "families": per_family,
        "findings": findings,
    }


# ---- idle connections -----------------------------------------------------------------------------------------------


def proc_threads() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return -1


def raise_nofile(needed: int) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits: dict[str, Any] = {"soft_before": soft, "hard": hard, "raised": False}
    if soft != resource.RLIM_INFINITY and soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        limits["raised"] = True
    limits["soft"] = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return limits


def post_once(address: tuple[str, int], body: bytes, timeout_s: float = 30.0) -> tuple[int, float]:
    """One decision request on a new connection: (status, milliseconds)."""
    start = time.perf_counter()
    with socket.create_connection(address, timeout=timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(http_request(body=body, extra=[b"Connection: close"]))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data[9:12] or 0), (time.perf_counter() - start) * 1000


def timed_requests(address: tuple[str, int], count: int) -> tuple[list[float], list[int]]:
    times, statuses = [], []
    for index in range(count):
        status, ms = post_once(address, json.dumps(short_request(index)).encode())
        times.append(ms)
        statuses.append(status)
    return times, statuses


def run_idle(connections: int, *, model: Any, requests: int = 50) -> dict[str, Any]:
    """`connections` idle connections (half silent, half an unfinished head) against `requests` timed requests."""
    limits = raise_nofile(2 * connections + 256)  # both ends of every connection live in this process
    with DecisionServer(model, port=0, access_log=io.StringIO()) as server:
        server.start()
        address = server.server_address
        timed_requests(address, 10)  # warm-up
        without, statuses_without = timed_requests(address, requests)
        threads_before = (threading.active_count(), proc_threads())
        idle = []
        try:
            for index in range(connections):
                sock = socket.create_connection(address, timeout=30.0)
                if index % 2:
                    sock.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: localhost\r\nContent-Ty")
                idle.append(sock)
            deadline = time.perf_counter() + 30.0
            while len(server.uvicorn.server_state.connections) < connections and time.perf_counter() < deadline:
                time.sleep(0.01)
            held = len(server.uvicorn.server_state.connections)
            threads_during = (threading.active_count(), proc_threads())
            with_idle, statuses_with = timed_requests(address, requests)
            still_open = len(server.uvicorn.server_state.connections)
        finally:
            for sock in idle:
                sock.close()
        threads_after = (threading.active_count(), proc_threads())
    stats_without, stats_with = latency_stats(without), latency_stats(with_idle)
    delay = stats_with["p50_ms"] - stats_without["p50_ms"]
    return {
        "connections": connections,
        "silent": connections - connections // 2,
        "unfinished_head": connections // 2,
        "held_by_server": held,
        "held_after_the_requests": still_open,
        "requests": requests,
        "without_idle": stats_without,
        "with_idle": stats_with,
        "statuses": dict(Counter(statuses_without + statuses_with)),
        "p50_delay_ms": delay,
        "threads": {
            "active_count": {"before": threads_before[0], "during": threads_during[0], "after": threads_after[0]},
            "proc_status": {"before": threads_before[1], "during": threads_during[1], "after": threads_after[1]},
        },
        "nofile": limits,
        "target_p50_delay_ms": IDLE_DELAY_TARGET_MS,
        "meets_target": delay < IDLE_DELAY_TARGET_MS and threads_during[1] <= threads_before[1],
    }


# ---- amplification --------------------------------------------------------------------------------------------------


def vm_rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


class RssSampler:
    """VmRSS every `interval_s` on a thread; `peak_since(mark)` is the largest sample since `mark()`."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def mark(self) -> int:
        self.peak = value = vm_rss_kb()
        return value

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, vm_rss_kb())
            self.samples += 1


def get_once(address: tuple[str, int], path: str = "/health") -> tuple[int, float]:
    start = time.perf_counter()
    with socket.create_connection(address, timeout=30.0) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(http_request("GET", path, extra=[b"Connection: close"]))
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data[9:12] or 0), (time.perf_counter() - start) * 1000


def small_client(send: Callable[[], tuple[int, float]], stop: threading.Event, window: dict, during: list) -> None:
    """`send` every `SMALL_PAUSE_S` until `stop`; the times of those that overlap `window` (start, end) go to
    `during`."""
    while not stop.wait(SMALL_PAUSE_S):
        sent = time.perf_counter()
        _, ms = send()
        if sent < window.get("end", 1e18) and sent + ms / 1000 > window.get("start", 1e18):
            during.append(ms)


@contextlib.contextmanager
def small_clients(senders: dict[str, Callable[[], tuple[int, float]]], window: dict, times: dict[str, list[float]]):
    """Each of `senders` as a `small_client` thread while the block runs (its times in `times[name]`)."""
    stop = threading.Event()
    clients = [
        threading.Thread(target=small_client, args=(send, stop, window, times[name]), daemon=True)
        for name, send in senders.items()
    ]
    for client in clients:
        client.start()
    try:
        yield
    finally:
        stop.set()
        for client in clients:
            client.join()


def run_amplification(*, model: Any, repeats: int = 3) -> dict[str, Any]:
    """Each body `repeats` times (the first in a process that never saw it): time to the 422, peak RSS growth, and
    two other clients' requests during it (a short decision request, `GET /health`, 5 ms apart) against the same
    two clients for 1.5 s without it; then
    once more under tracemalloc for the peak of Python allocations (all threads, the client's included)."""
    bodies = {"amplification_body": amplification_body(), "many_candidates_body": many_candidates_body()}
    short = json.dumps(short_request(0)).encode()
    with DecisionServer(model, port=0, access_log=io.StringIO()) as server, RssSampler() as sampler:
        server.start()
        address = server.server_address
        senders = {"decide": lambda: post_once(address, short), "health": lambda: get_once(address)}
        timed_requests(address, 10)  # warm-up
        before: dict[str, list[float]] = {other: [] for other in senders}
        window = {"start": time.perf_counter(), "end": time.perf_counter() + 1.5}  # both clients, no big request
        with small_clients(senders, window, before):
            time.sleep(1.5)
        results = {}
        for name, body in bodies.items():
            runs = []
            during: dict[str, list[float]] = {other: [] for other in senders}
            for _ in range(repeats):
                window = {}
                with small_clients(senders, window, during):
                    time.sleep(0.05)
                    base = sampler.mark()
                    window["start"] = time.perf_counter()
                    status, ms = post_once(address, body)
                    window["end"] = time.perf_counter()
                    time.sleep(0.005)  # a sample after the answer
                    runs.append({"status": status, "ms": ms, "peak_rss_growth_mb": (sampler.peak - base) / 1024})
            tracemalloc.start()
            tracemalloc.reset_peak()
            traced_base = tracemalloc.get_traced_memory()[0]
            post_once(address, body)
            traced_peak = tracemalloc.get_traced_memory()[1] - traced_base
            tracemalloc.stop()
            worst_s = max(run["ms"] for run in runs) / 1000
            worst_mb = max(run["peak_rss_growth_mb"] for run in runs)
            results[name] = {
                "bytes": len(body),
                "runs": runs,
                "max_seconds": worst_s,
                "max_peak_rss_growth_mb": worst_mb,
                "tracemalloc_peak_mb": traced_peak / 2**20,
                "during": {other: latency_stats(times) for other, times in during.items()},
                "meets_time_and_memory_targets": all(run["status"] == 422 for run in runs)
                and worst_s < AMPLIFICATION_TARGET_S
                and worst_mb < AMPLIFICATION_TARGET_MB
                and traced_peak / 2**20 < AMPLIFICATION_TARGET_MB,
            }
        samples = sampler.samples
    return {
        "model": f"{model.weights.model_id} on {getattr(model.backbone, 'name', '?')}",
        "memory": "peak_rss_growth_mb: VmRSS of /proc/self/status sampled every 1 ms on a thread, the peak during the "
        "request minus the value just before it (the whole process: server, clients, sampler); tracemalloc_peak_mb: "
        "tracemalloc's peak over one more request minus its traced size before it (Python allocations of all threads)",
        "rss_samples": samples,
        "before": {name: latency_stats(times) for name, times in before.items()},
        "bodies": results,
        "target_seconds": AMPLIFICATION_TARGET_S,
        "target_peak_growth_mb": AMPLIFICATION_TARGET_MB,
    }


# ---- the record -----------------------------------------------------------------------------------------------------


def print_table(record: dict[str, Any], out: Any = sys.stdout) -> None:
    campaign = record["campaign"]
    print(f"fuzz campaign: {campaign['fuzz_cases']} cases + {campaign['controls']} controls, {campaign['seconds']} s, "
          f"seed {campaign['seed']}", file=out)  # fmt: skip
    for family, row in campaign["families"].items():
        statuses = ", ".join(f"{status}: {count}" for status, count in row["statuses"].items())
        print(f"  {family:<13} {row['cases']:>5}  {statuses}", file=out)
    print("  findings: " + ", ".join(f"{k} {v}" for k, v in campaign["finding_counts"].items()), file=out)
    if "idle" in record:
        idle = record["idle"]
        print(f"idle: {idle['connections']} connections, P50 {idle['without_idle']['p50_ms']:.2f} -> "
              f"{idle['with_idle']['p50_ms']:.2f} ms (max {idle['with_idle']['max_ms']:.2f}), threads "
              f"{idle['threads']['proc_status']}", file=out)  # fmt: skip
    if "amplification" in record:
        amplification = record["amplification"]
        before = {name: stats["p50_ms"] for name, stats in amplification["before"].items()}
        for name, row in amplification["bodies"].items():
            during = {other: stats["p50_ms"] if stats else float("nan") for other, stats in row["during"].items()}
            print(f"{name}: {row['bytes']} B, 422 in <= {row['max_seconds'] * 1000:.0f} ms, peak RSS growth "
                  f"<= {row['max_peak_rss_growth_mb']:.1f} MB, tracemalloc peak {row['tracemalloc_peak_mb']:.1f} MB; "
                  "P50 of other clients before -> during: "
                  + ", ".join(f"{other} {before[other]:.1f} -> {during[other]:.1f} ms" for other in during),
                  file=out)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=TINY.name, help="shapes of the overhead model")
    parser.add_argument("--backend", default=None, help="a registry stage over the tiny twin instead")
    parser.add_argument("--body-timeout", type=float, default=1.0, help="the server's body and head timeout (s)")
    parser.add_argument("--idle", type=int, default=1000, help="idle connections (0: skip the section)")
    parser.add_argument("--no-amplification", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    fast = campaign_model(args.shapes, args.backend)
    record: dict[str, Any] = {
        "what": "fuzz campaign, idle connections and amplification bodies against engine.server "
        "(ablations/fuzz_server.py)",
        "config": {
            "cases": args.cases,
            "seed": args.seed,
            "model": f"{fast.weights.model_id} on {getattr(fast.backbone, 'name', '?')}",
            "body_timeout_s": args.body_timeout,
            "control_every": CONTROL_EVERY,
            "families": list(FAMILIES),
        },
    }
    record["campaign"] = run_campaign(args.cases, args.seed, model=fast, body_timeout_s=args.body_timeout)
    if args.idle:
        record["idle"] = run_idle(args.idle, model=fast)
    if not args.no_amplification:
        record["amplification"] = run_amplification(model=build_decision_model("hf_torch", TINY.name))
    record["environment"] = envinfo.collect("cpu")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2, ensure_ascii=True) + "\n")
    print_table(record)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
