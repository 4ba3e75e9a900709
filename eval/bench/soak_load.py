"""The soak benchmark's clients: mixed chat/completion traffic with sessions, streams, cancellations and slow readers,
beside a stalled reader and a /metrics scrape flood.

Each client loops until the deadline, drawing one scenario at a time; every answer is classified against what
that client asked for: completed, cancelled by the client (it closed the stream or gave up waiting), refused
with a 4xx (only the deliberately invalid scenario expects one), stalled (the stalled reader's stream, cut by the
server's send timeout), or unexpected (a 5xx, an error event inside a stream, a dropped connection, a timeout).
Beside them: stalled readers, each opening a stream that outgrows the socket buffers and then taking nothing for
longer than the server's send timeout (ServerSettings.stream_stall_s, 30 s), so the server's stall path (abort,
pages back, connection closed) runs; and scrapers, each reading /metrics at about 20 Hz. A run is healthy when
`unexpected` stays 0.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("river walk lunch rain map bridge forest hill coffee train city harbour garden museum evening "
         "bicycle picnic mountain lake north south quiet market castle library").split()
SCENARIOS = ("chat_session", "completion", "stream", "stream_cancel", "cancel_early", "slow_reader", "disconnect",
             "penalties", "invalid")
_WEIGHTS = (4, 2, 3, 2, 1, 1, 1, 1, 1)
_CLIENT_TIMEOUT_S = 120.0
STALL_MARGIN_S = 10.0       # a stalled reader takes nothing for 1.25 x the server's send timeout plus this
SCRAPE_HZ = 20.0


@dataclass
class Tally:
    """Outcome counts per scenario: completed / cancelled / refused / unexpected (with the first few reasons)."""

    counts: dict[str, Counter] = field(default_factory=dict)
    reasons: list[str] = field(default_factory=list)

    def add(self, scenario: str, outcome: str, reason: str = "") -> None:
        self.counts.setdefault(scenario, Counter())[outcome] += 1
        if outcome == "unexpected" and len(self.reasons) < 20:
            self.reasons.append(f"{scenario}: {reason}")

    def total(self, outcome: str) -> int:
        return sum(c[outcome] for c in self.counts.values())


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def _post(http: httpx.AsyncClient, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return await http.post(path, json=body, headers=headers or {})


async def _read_stream(http: httpx.AsyncClient, path: str, body: dict, rng: random.Random, *,
                       stop_after: int | None = None, delay_s: float = 0.0) -> str:
    """'completed', 'cancelled' (stopped reading after stop_after events) or raises ValueError(reason)."""
    async with http.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            await response.aread()
            raise ValueError(f"HTTP {response.status_code}: {response.text[:120]}")
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if '"error"' in line[:20]:
                raise ValueError(f"error event: {line[:160]}")
            if line == "data: [DONE]":
                return "completed"
            events += 1
            if stop_after is not None and events >= stop_after:
                return "cancelled"             # leaving the block closes the connection mid-stream
            if delay_s:
                await asyncio.sleep(delay_s * rng.random())
        raise ValueError("stream ended without [DONE]")


async def one_scenario(http: httpx.AsyncClient, scenario: str, rng: random.Random, client_id: int) -> tuple[str, str]:
    """Runs one scenario; returns (outcome, reason)."""
    max_tokens = rng.choice((8, 16, 32, 64))
    temperature = rng.choice((0.0, 0.0, 0.7))
    prompt = _text(rng, rng.randint(5, 60))
    chat = {"model": "tiny", "max_tokens": max_tokens, "temperature": temperature,
            "messages": [{"role": "user", "content": prompt}]}
    completion = {"model": rng.choice(("tiny", "tiny-s", "tiny-l")), "prompt": prompt, "max_tokens": max_tokens,
                  "temperature": temperature}
    if scenario == "chat_session":
        session = f"soak-{client_id}-{rng.randrange(4)}"
        messages = chat["messages"]
        for _ in range(rng.randint(1, 3)):
            response = await _post(http, "/v1/chat/completions", {**chat, "messages": messages},
                                   {"X-Session-ID": session})
            if response.status_code != 200:
                return "unexpected", f"HTTP {response.status_code}: {response.text[:120]}"
            answer = response.json()["choices"][0]["message"]["content"]
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": _text(rng, rng.randint(3, 20))}]
        return "completed", ""
    if scenario in ("completion", "penalties"):
        body = completion if scenario == "completion" else {
            **completion, "frequency_penalty": rng.uniform(-2, 2), "presence_penalty": rng.uniform(-2, 2),
            "repetition_penalty": rng.uniform(0.5, 2.0), "logit_bias": {str(rng.randrange(4096)): -100}}
        response = await _post(http, "/v1/completions", body)
        return ("completed", "") if response.status_code == 200 else \
            ("unexpected", f"HTTP {response.status_code}: {response.text[:120]}")
    if scenario == "invalid":
        body = rng.choice(({**completion, "temperature": 9}, {**chat, "messages": []}, {**chat, "tools": [{}]},
                           {**completion, "max_tokens": 10**9}, {**completion, "logit_bias": {"x": 1}}))
        response = await _post(http, "/v1/completions" if "prompt" in body else "/v1/chat/completions", body)
        return ("refused", "") if 400 <= response.status_code < 500 and "error" in response.json() else \
            ("unexpected", f"HTTP {response.status_code} for an invalid body")
    if scenario == "disconnect":             # gives up waiting for a long answer: the server sees it leave
        try:
            await asyncio.wait_for(_post(http, "/v1/completions", {**completion, "max_tokens": 256,
                                                                   "ignore_eos": True}), rng.uniform(0.05, 0.5))
        except asyncio.TimeoutError:
            return "cancelled", ""
        return "completed", ""
    path, body = rng.choice((("/v1/chat/completions", chat), ("/v1/completions", completion)))
    if scenario == "cancel_early":           # gives up within 50 ms: before admission, in the queue or the prefill
        try:
            await asyncio.wait_for(_read_stream(http, path, {**body, "max_tokens": 128, "ignore_eos": True}, rng),
                                   rng.uniform(0.0, 0.05))
        except asyncio.TimeoutError:
            return "cancelled", ""
        except ValueError as exc:
            return "unexpected", str(exc)
        return "completed", ""
    if scenario == "stream":
        return await _stream_outcome(http, path, body, rng)
    if scenario == "stream_cancel":
        return await _stream_outcome(http, path, {**body, "max_tokens": 128, "ignore_eos": True}, rng,
                                     stop_after=rng.randint(1, 6))
    return await _stream_outcome(http, path, body, rng, delay_s=0.3)      # slow_reader


async def _stream_outcome(http, path, body, rng, **kwargs) -> tuple[str, str]:
    try:
        return await _read_stream(http, path, body, rng, **kwargs), ""
    except ValueError as exc:
        return "unexpected", str(exc)


async def client_loop(url: str, client_id: int, deadline_s: float, tally: Tally, seed: int) -> None:
    rng = random.Random(seed * 1000 + client_id)
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
    async with httpx.AsyncClient(base_url=url, timeout=_CLIENT_TIMEOUT_S, limits=limits) as http:
        while time.monotonic() < deadline_s:
            scenario = rng.choices(SCENARIOS, _WEIGHTS)[0]
            try:
                outcome, reason = await one_scenario(http, scenario, rng, client_id)
            except (httpx.HTTPError, OSError) as exc:
                outcome, reason = "unexpected", f"{type(exc).__name__}: {exc}"
            tally.add(scenario, outcome, reason)


# ----------------------------------------------------------------------------- the stalled reader
# A chat stream with 20 top logprobs a token: about 1 kB of SSE per token, ~1 MB for the answer, far more than the
# reader's 4 kB receive window, the server's socket buffer and its transport's high-water mark hold together.
STALL_BODY = {"model": "tiny-s", "messages": [{"role": "user", "content": "Tell me about the river."}],
              "max_tokens": 900, "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}


def stall_hold_s(stall_s: float) -> float:
    """How long a stalled reader takes nothing: past the server's send timeout and its watchdog's period
    (SSEResponse checks every stall_s / 4), with a margin."""
    return stall_s * 1.25 + STALL_MARGIN_S


async def stalled_stream(url: str, stall_s: float, rcvbuf_bytes: int = 4096,
                         mss_bytes: int = 1024) -> tuple[str, str]:
    """One stream whose client reads the first event, then nothing for stall_hold_s, then the rest. The server
    must have cut it (no [DONE], connection closed): 'stalled'; anything else is 'unexpected' with a reason.

    On loopback the segment size is 64 kB and Linux sizes a new connection's send buffer from it (~2.6-4 MB, more
    than the whole answer), so the reader announces a small segment size as a client across a network does (the
    server's send buffer is then some tens of kB), offers a small receive window and stops its own transport reading
    (an asyncio reader would otherwise buffer the answer in user space)."""
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)   # before connect: a small window
    if hasattr(socket, "TCP_MAXSEG"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, mss_bytes)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=2**20)
    try:
        payload = json.dumps(STALL_BODY).encode()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(payload), payload))
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _CLIENT_TIMEOUT_S)
        if not head.startswith(b"HTTP/1.1 200"):
            status_line = head.split(b"\r\n", 1)[0].decode(errors="replace")
            return "unexpected", f"stalled reader: {status_line}"
        await asyncio.wait_for(reader.readuntil(b"data: "), _CLIENT_TIMEOUT_S)    # the first event
        writer.transport.pause_reading()
        await asyncio.sleep(stall_hold_s(stall_s))
        writer.transport.resume_reading()
        rest = await asyncio.wait_for(reader.read(), _CLIENT_TIMEOUT_S)     # to EOF: the server closed it
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError) as exc:
        return "unexpected", f"stalled reader: {type(exc).__name__}: {exc}"
    finally:
        writer.close()
    if b"data: [DONE]" in rest:
        return "unexpected", "stalled reader: the stream completed; the server never cut it"
    if b'{"error"' in rest:
        return "unexpected", "stalled reader: an error event instead of a cut"
    return "stalled", ""


async def stalled_reader_loop(url: str, deadline_s: float, tally: Tally, stall_s: float) -> None:
    """Stalled streams one after another while one still ends before the deadline (at least one)."""
    first = True
    while first or time.monotonic() + stall_hold_s(stall_s) + 5 < deadline_s:
        first = False
        tally.add("stalled_reader", *await stalled_stream(url, stall_s))


# ----------------------------------------------------------------------------- the /metrics scrape flood
async def scraper_loop(url: str, deadline_s: float, tally: Tally, hz: float = SCRAPE_HZ) -> None:
    """Reads /metrics about hz times a second until the deadline; each scrape must be a 200 with the engine up."""
    period_s = 1.0 / hz
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while (started_s := time.monotonic()) < deadline_s:
            try:
                response = await http.get("/metrics")
                ok = response.status_code == 200 and "mfs_engine_up 1.0" in response.text
                tally.add("metrics_scrape", "completed" if ok else "unexpected",
                          f"HTTP {response.status_code}: {response.text[:120]}")
            except (httpx.HTTPError, OSError) as exc:
                tally.add("metrics_scrape", "unexpected", f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(max(0.0, period_s - (time.monotonic() - started_s)))


async def run_load(url: str, clients: int, duration_s: float, seed: int, *, stalled_readers: int = 1,
                   scrapers: int = 4, stall_s: float | None = None) -> Tally:
    """clients scenario loops, stalled_readers stalled readers (each holding a stream past the server's send
    timeout, stall_s: ServerSettings.stream_stall_s by default) and scrapers /metrics readers at SCRAPE_HZ."""
    if stall_s is None:
        from orchestrator.serve.edge import ServerSettings
        stall_s = ServerSettings().stream_stall_s
    tally = Tally()
    deadline_s = time.monotonic() + duration_s
    await asyncio.gather(*(client_loop(url, i, deadline_s, tally, seed) for i in range(clients)),
                         *(stalled_reader_loop(url, deadline_s, tally, stall_s) for _ in range(stalled_readers)),
                         *(scraper_loop(url, deadline_s, tally) for _ in range(scrapers)))
    return tally
