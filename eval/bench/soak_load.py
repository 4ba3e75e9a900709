"""The soak benchmark's clients: mixed chat/completion traffic with sessions, streams, cancellations and slow readers.

Each client loops until the deadline, drawing one scenario at a time; every answer is classified against what
that client asked for: completed, cancelled by the client (it closed the stream or gave up waiting), refused
with a 4xx (only the deliberately invalid scenario expects one), or unexpected (a 5xx, an error event inside a
stream, a dropped connection, a timeout). A run is healthy when `unexpected` stays 0.
"""
from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

WORDS = ("river walk lunch rain map bridge forest hill coffee train city harbour garden museum evening "
         "bicycle picnic mountain lake north south quiet market castle library").split()
SCENARIOS = ("chat_session", "completion", "stream", "stream_cancel", "slow_reader", "disconnect", "penalties",
             "invalid")
_WEIGHTS = (4, 2, 3, 2, 1, 1, 1, 1)
_CLIENT_TIMEOUT_S = 120.0


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


async def run_load(url: str, clients: int, duration_s: float, seed: int) -> Tally:
    tally = Tally()
    deadline_s = time.monotonic() + duration_s
    await asyncio.gather(*(client_loop(url, i, deadline_s, tally, seed) for i in range(clients)))
    return tally
