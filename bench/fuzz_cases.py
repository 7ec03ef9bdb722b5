"""The fuzz cases of `bench.fuzz_server`: seeded malformed requests in six families, and the valid controls.

`generate_cases(count, seed, port)` draws `count` cases evenly from `FAMILIES` (mutated JSON bodies, broken framing,
bad request lines and targets, header abuse, slow clients, pipelined requests) with one valid control after every
`CONTROL_EVERY`; each `Case` is the raw bytes to send (in timed pieces) and what a correct server's answers may be.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("json_body", "framing", "request_line", "headers", "slow", "pipelined")
CONTROL_EVERY = 10  # one valid control after every this many fuzz cases
POST = "/v1/systemone"


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
    version_505_ok: bool = False  # a 505 is justified (the request line names HTTP/2 or later)
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


def version_case(rng: random.Random, body: bytes) -> Case:
    """A request line with an HTTP version drawn from the valid, the later and the malformed ones."""
    method, target = rng.choice(["GET", "POST"]), rng.choice(["/health", POST])
    version = rng.choice(
        ["HTTP/0.9", "HTTP/1.0", "HTTP/2.0", "HTTP/1.2", "HTTP/9.9", "HTTX/1.1", "http/1.1", "HTTP/1.1 x"]
    )
    raw = http_request(method, target, body, version=version)
    return one("request_line", "version", raw, version_505_ok=version in ("HTTP/2.0", "HTTP/9.9"))


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
        "version": lambda: version_case(rng, body),
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
