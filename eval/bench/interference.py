"""Interference benchmark: how much one client's abuse slows the other clients' streams on a real `mfs serve`.

Starts `mfs serve` once (the shipped tiny family, the server's default settings) and runs victim streams: --streams
concurrent greedy completions of tiny-l (a fixed prompt, temperature 0, ignore_eos, --tokens tokens each). A
stream's figure is its time per streamed token, (last token - first token) / (tokens - 1), and its largest gap
between two tokens (a stall shows there). Each victim run happens under one condition (the disturbers in a process
of their own, as other machines' clients would be: their work never delays the victims' event loop):

  quiet          the victims alone
  big_prompts    two clients POSTing a ~4 MB prompt to /v1/completions in a loop (the server refuses it: 4xx),
                 one after another or --big-hz a second each
  scrape         four clients GETting /metrics at 20 Hz each (on the clock: 80 requests a second offered)

A round runs quiet, one disturbed condition, quiet, the other (A B A C; the disturbed ones swap places from one
round to the next), and each disturbed run is paired with the quiet run just before it: its effect is
disturbed / quiet - 1. The summary holds each condition's median over rounds of the mean time per token and the
min / median / max of the paired effects. A quiet run before the first round warms the server up (recorded, not
counted).

--u-fffd measures instead whether streaming stays linear in the answer's length when the answer's tail decodes to
U+FFFD (ids that are incomplete UTF-8 alone, forced with logit_bias): one stream per length, wall time per token
at each, and the ratio of the longest to the shortest (near 1 when the work per token does not grow). Lengths over
what the model's context allows after the prompt are cut to that.

    python -m eval.bench.interference --out artifacts/interference.json
    python -m eval.bench.interference --u-fffd --out artifacts/interference_fffd.json
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import multiprocessing
import signal
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from eval.bench.servers import (
    MODEL,
    TINY_DIR,
    free_port,
    launch,
    mfs_spec,
    shut_down,
    sse_events,
    wait_ready,
)
from eval.machine import machine

PROMPT = "The river runs past the old mill, under the stone bridge and on towards the harbour, where"
CONDITIONS = ("quiet", "big_prompts", "scrape")
FFFD_IDS = 4                    # how many U+FFFD ids the linearity stream is biased towards
READY_TIMEOUT_S = 300.0
DRAIN_TIMEOUT_S = 30.0          # after the victims: how long a disturber may take to finish its request
MAX_OUTSTANDING = 64            # a paced disturber's requests in flight at most


@dataclasses.dataclass(slots=True)
class Disturbance:
    """What the disturbers send: big_clients POSTing a prompt of prompt_bytes characters, each one request after
    another (big_hz 0) or big_hz a second; scrapers GETting /metrics at scrape_hz each. A paced disturber sends
    on its clock whether or not earlier requests were answered (at most MAX_OUTSTANDING in flight), so the offered
    rate is what was asked, however slow the answers."""

    big_clients: int = 2
    prompt_bytes: int = 4_000_000
    scrapers: int = 4
    scrape_hz: float = 20.0
    big_hz: float = 0.0


DEFAULT = Disturbance()


# ----------------------------------------------------------------------------- one stream
async def stream(http: aiohttp.ClientSession, url: str, max_tokens: int, **extra) -> dict:
    """One streamed greedy completion: tokens, wall time from send to the last token, time per streamed token
    and the largest gap between two tokens (a chunk's tokens are stamped with its arrival)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True, **extra}
    sent_s = time.monotonic()
    stamps: list[float] = []
    async with http.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"victim stream: HTTP {resp.status}: {(await resp.text())[:200]}")
        async for event in sse_events(resp.content):
            if "error" in event:
                raise RuntimeError(f"victim stream: error event {event['error']}")
            now_s = time.monotonic()
            for choice in event.get("choices", []):
                stamps += [now_s] * len(choice.get("token_ids") or ())
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"tokens": len(stamps), "wall_s": stamps[-1] - sent_s if stamps else None,
            "first_token_s": stamps[0] - sent_s if stamps else None,
            "s_per_token": (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
            "max_gap_s": max(gaps, default=None)}


# ----------------------------------------------------------------------------- disturbers
async def send_one(http: aiohttp.ClientSession, method: str, url: str, answers: Counter, data: bytes | None) -> None:
    """One request; its answer counted by status (a failed request by its exception's name)."""
    headers = {"Content-Type": "application/json"} if data is not None else None
    try:
        async with http.request(method, url, data=data, headers=headers) as resp:
            await resp.read()
            answers[str(resp.status)] += 1
    except (aiohttp.ClientError, OSError) as exc:
        answers[type(exc).__name__] += 1


async def disturber(http: aiohttp.ClientSession, method: str, url: str, period_s: float, stop: asyncio.Event,
                    answers: Counter, data: bytes | None = None) -> None:
    """Until stop: one request after another (period_s 0: a closed loop), or one every period_s on the clock
    (an open loop, at most MAX_OUTSTANDING in flight; a send that would pass it is skipped and counted)."""
    if not period_s:
        while not stop.is_set():
            await send_one(http, method, url, answers, data)
        return
    in_flight: set[asyncio.Task] = set()
    next_s = time.monotonic()
    while not stop.is_set():
        if len(in_flight) < MAX_OUTSTANDING:
            task = asyncio.create_task(send_one(http, method, url, answers, data))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)
        else:
            answers["skipped"] += 1
        next_s += period_s
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, next_s - time.monotonic()))
        except TimeoutError:
            pass
    if in_flight:
        await asyncio.wait(in_flight, timeout=DRAIN_TIMEOUT_S)


def disturbers(condition: str, http: aiohttp.ClientSession, url: str, dist: Disturbance, stop: asyncio.Event,
               answers: Counter, big_body: bytes) -> list:
    if condition == "big_prompts":
        period_s = 1.0 / dist.big_hz if dist.big_hz else 0.0
        return [disturber(http, "POST", url + "/v1/completions", period_s, stop, answers, big_body)
                for _ in range(dist.big_clients)]
    if condition == "scrape":
        return [disturber(http, "GET", url + "/metrics", 1.0 / dist.scrape_hz, stop, answers)
                for _ in range(dist.scrapers)]
    return []


def big_prompt_body(prompt_bytes: int) -> bytes:
    words = "river bridge harbour garden "
    prompt = (words * (prompt_bytes // len(words) + 1))[:prompt_bytes]
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})


async def disturb(condition: str, url: str, dist: Disturbance, conn) -> None:
    """The disturbers of one condition until the parent says stop: "ready" once each has had an answer, then
    the answers by status when they have finished (each request in flight is finished, bounded)."""
    answers: Counter = Counter()
    stop = asyncio.Event()
    big_body = big_prompt_body(dist.prompt_bytes) if condition == "big_prompts" else b""
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        tasks = [asyncio.create_task(d) for d in disturbers(condition, http, url, dist, stop, answers, big_body)]
        lead_until_s = time.monotonic() + DRAIN_TIMEOUT_S
        while sum(answers.values()) < len(tasks) and time.monotonic() < lead_until_s:
            await asyncio.sleep(0.01)
        conn.send("ready")
        await loop.run_in_executor(None, conn.recv)        # "stop"
        stop.set()
        _, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    conn.send(dict(sorted(answers.items())))


def disturber_process(condition: str, url: str, dist: Disturbance, conn) -> None:
    asyncio.run(disturb(condition, url, dist, conn))


async def victim_run(url: str, condition: str, streams: int, tokens: int, dist: Disturbance) -> dict:
    """The victims under one condition. The disturbers run in a process of their own (as other clients would
    be other machines: their sending and parsing never delays the victims' own event loop), from before the
    first victim's request (each has had an answer) until the last victim's last token."""
    answers: dict = {}
    process = None
    loop = asyncio.get_running_loop()
    if condition != "quiet":
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(target=disturber_process, args=(condition, url, dist, child_conn), daemon=True)
        process.start()
        if not await loop.run_in_executor(None, conn.poll, READY_TIMEOUT_S):
            process.kill()
            raise RuntimeError(f"{condition}: the disturbers got no answer within {READY_TIMEOUT_S:g} s")
        conn.recv()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    try:
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
            victims = await asyncio.gather(*(stream(http, url, tokens) for _ in range(streams)))
    finally:
        if process is not None:
            conn.send("stop")
            if await loop.run_in_executor(None, conn.poll, 2 * DRAIN_TIMEOUT_S):
                answers = conn.recv()
            process.join(5.0)
            if process.is_alive():
                process.kill()
    per_token = [v["s_per_token"] for v in victims if v["s_per_token"] is not None]
    return {"condition": condition,
            "mean_s_per_token": statistics.mean(per_token) if per_token else None,
            "max_gap_s": max((v["max_gap_s"] for v in victims if v["max_gap_s"] is not None), default=None),
            "victim_tokens": [v["tokens"] for v in victims], "victims": victims, "disturber_answers": answers}


# ----------------------------------------------------------------------------- the rounds
def round_order(round_index: int) -> list[str]:
    """A B A C, the disturbed conditions swapping places from one round to the next."""
    disturbed = list(CONDITIONS[1:]) if round_index % 2 == 0 else list(reversed(CONDITIONS[1:]))
    order = []
    for condition in disturbed:
        order += ["quiet", condition]
    return order


def progress(label: str, run: dict) -> None:
    per_token = run["mean_s_per_token"]
    gap = run["max_gap_s"]
    print(f"{label} {run['condition']:<12} {1000 * per_token if per_token else float('nan'):7.2f} ms/token, "
          f"max gap {1000 * gap if gap else float('nan'):7.1f} ms, tokens {run['victim_tokens']}, "
          f"disturbers {run['disturber_answers'] or '-'}", file=sys.stderr, flush=True)


async def interference(url: str, rounds: int, streams: int, tokens: int, dist: Disturbance) -> dict:
    warmup = await victim_run(url, "quiet", streams, tokens, dist)
    progress("[warm-up]  ", warmup)
    per_round: list[list[dict]] = []
    for r in range(rounds):
        runs: list[dict] = []
        for condition in round_order(r):
            run = await victim_run(url, condition, streams, tokens, dist)
            run["round"] = r
            if condition != "quiet":
                run["paired_quiet_s_per_token"] = runs[-1]["mean_s_per_token"]
            runs.append(run)
            progress(f"[round {r + 1}/{rounds}]", run)
        per_round.append(runs)
    return {"warmup": warmup, "rounds": per_round, "summary": summarize(per_round)}


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else \
        {"min": None, "median": None, "max": None}


def summarize(per_round: list[list[dict]]) -> dict:
    """Per condition: its median over rounds of the mean time per token (a round's quiet figure is the mean of its
    quiet runs), and for a disturbed one each run's effect against the quiet run before it."""
    summary = {}
    for condition in CONDITIONS:
        round_means = []
        for runs in per_round:
            figures = [run["mean_s_per_token"] for run in runs
                       if run["condition"] == condition and run["mean_s_per_token"] is not None]
            if figures:
                round_means.append(statistics.mean(figures))
        entry = {"round_s_per_token": round_means,
                 "median_ms_per_token": 1000 * statistics.median(round_means) if round_means else None}
        if condition != "quiet":
            effects = [run["mean_s_per_token"] / run["paired_quiet_s_per_token"] - 1
                       for runs in per_round for run in runs if run["condition"] == condition
                       and run["mean_s_per_token"] and run.get("paired_quiet_s_per_token")]
            entry["paired_effects"] = effects
            entry["effect"] = _spread(effects)
        summary[condition] = entry
    return summary


def table(summary: dict) -> str:
    def pct(value) -> str:
        return "-" if value is None else f"{100 * value:+.1f}%"

    lines = [f"{'condition':<12} {'ms/token':>9} {'effect':>9}  min .. max"]
    for condition, entry in summary.items():
        ms = entry["median_ms_per_token"]
        effect = entry.get("effect")
        spread = f"{pct(effect['min'])} .. {pct(effect['max'])}" if effect else ""
        lines.append(f"{condition:<12} {ms if ms is not None else float('nan'):9.2f} "
                     f"{pct(effect['median']) if effect else '':>9}  {spread}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- U+FFFD linearity
def fffd_ids(count: int = FFFD_IDS) -> list[int]:
    """The first `count` ids of the tiny tokenizer whose text alone is U+FFFD (an incomplete UTF-8 sequence)."""
    from orchestrator.serve.tokenizer import FamilyTokenizer

    texts = FamilyTokenizer(TINY_DIR / MODEL).vocab_texts()
    return [token_id for token_id, text in enumerate(texts) if text == "\ufffd"][:count]


def fffd_lengths(requested: list[int]) -> list[int]:
    """The requested lengths, each cut to what the model's context leaves after the prompt."""
    from orchestrator.core.family import load_family
    from orchestrator.serve.tokenizer import FamilyTokenizer

    room = load_family(TINY_DIR).member(MODEL).context_tokens - len(FamilyTokenizer(TINY_DIR / MODEL).encode(PROMPT))
    return sorted({min(n, room) for n in requested})


async def u_fffd(url: str, lengths: list[int], repeats: int) -> dict:
    ids = fffd_ids()
    bias = {str(token_id): 100 for token_id in ids}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    per_length: list[dict] = []
    figures: list[float | None] = []
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await stream(http, url, min(lengths), logit_bias=bias)           # warm-up
        for n in lengths:
            runs = [await stream(http, url, n, logit_bias=bias) for _ in range(repeats)]
            per_token = [run["wall_s"] / run["tokens"] for run in runs if run["tokens"]]
            figure = statistics.median(per_token) if per_token else None
            figures.append(figure)
            per_length.append({"max_tokens": n, "tokens": [run["tokens"] for run in runs], "runs": runs,
                               "wall_s_per_token": figure})
            print(f"[u+fffd] {n:5d} tokens: {1000 * figure if figure else float('nan'):.2f} ms/token (wall, "
                  f"median of {len(per_token)})", file=sys.stderr, flush=True)
    first, last = figures[0], figures[-1]
    return {"fffd_ids": ids, "lengths": per_length,
            "ratio": {"long_max_tokens": lengths[-1], "short_max_tokens": lengths[0],
                      "long_vs_short": last / first if first and last else None}}


# ----------------------------------------------------------------------------- main
def server_settings(argv: list[str]) -> dict:
    from orchestrator.serve.edge import ServerSettings

    return {"argv": argv, "model": MODEL, "edge_defaults": dataclasses.asdict(ServerSettings())}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.interference", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the result JSON")
    parser.add_argument("--rounds", type=int, default=3, help="A B A C rounds (in --u-fffd: streams per length)")
    parser.add_argument("--streams", type=int, default=3, help="concurrent victim streams")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per victim stream")
    parser.add_argument("--prompt-bytes", type=int, default=DEFAULT.prompt_bytes,
                        help="characters of each big prompt (default about 4 MB)")
    parser.add_argument("--big-clients", type=int, default=DEFAULT.big_clients)
    parser.add_argument("--big-hz", type=float, default=DEFAULT.big_hz,
                        help="big prompts a second, each client (0: one after another, as fast as answered)")
    parser.add_argument("--scrapers", type=int, default=DEFAULT.scrapers)
    parser.add_argument("--scrape-hz", type=float, default=DEFAULT.scrape_hz, help="scrapes a second, each")
    parser.add_argument("--u-fffd", action="store_true",
                        help="measure streaming linearity on an answer of U+FFFD ids instead")
    parser.add_argument("--fffd-lengths", default="250,500,1000,2000",
                        help="--u-fffd: max_tokens of the streams, comma-separated")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dist = Disturbance(args.big_clients, args.prompt_bytes, args.scrapers, args.scrape_hz, args.big_hz)
    port = free_port()
    spec = mfs_spec(port, [], name=out.stem + ".server")
    result: dict[str, Any] = {"command": " ".join(["python -m eval.bench.interference", *(sys.argv[1:] if argv is None else argv)]),
              "machine": machine(), "server": server_settings(spec.argv)}
    signal.signal(signal.SIGTERM, _interrupt)          # a kill stops the server too, as Ctrl-C does
    server = launch(spec, port, out.parent)
    try:
        asyncio.run(wait_ready(server.base_url, server.proc, READY_TIMEOUT_S))
        if args.u_fffd:
            lengths = fffd_lengths([int(n) for n in args.fffd_lengths.split(",")])
            result.update(mode="u_fffd", u_fffd=asyncio.run(u_fffd(server.base_url, lengths, args.rounds)))
        else:
            result.update(mode="interference", rounds_asked=args.rounds, streams=args.streams, tokens=args.tokens,
                          disturbance=dataclasses.asdict(dist),
                          **asyncio.run(interference(server.base_url, args.rounds, args.streams, args.tokens, dist)))
    except KeyboardInterrupt:
        print("interrupted: stopping the server", file=sys.stderr)
        return 130
    finally:
        shut_down(server)
    out.write_text(json.dumps(result, indent=1))
    if args.u_fffd:
        ratio = result["u_fffd"]["ratio"]
        for entry in result["u_fffd"]["lengths"]:
            figure = entry["wall_s_per_token"]
            print(f"{entry['max_tokens']:6d} tokens  {1000 * figure if figure else float('nan'):8.2f} ms/token")
        print(f"time per token at {ratio['long_max_tokens']} vs {ratio['short_max_tokens']}: "
              f"{ratio['long_vs_short'] or float('nan'):.3f}x")
    else:
        print(table(result["summary"]))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
