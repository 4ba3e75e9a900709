"""`mfs bench --peer vllm` (eval/bench/peer_bench.py): the balancers' choices, the KV split, the curve read against
a named baseline, the HTTP engine against a real `mfs serve`, eval's compared systems served over HTTP
(eval/bench/serve_system.py), and a smoke run against three vLLM-CPU servers (skipped where `make vllm-venv` has not
built their venv). Behaviour only, never timings."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval.baseline.static_split import proportional_split
from eval.bench.balancer import BalancedEngine, ComplexityBalancer, StickyBalancer, make_balancer
from eval.bench.peer import (BLOCK_TOKENS, KVShare, arena_bytes, kv_shares, member_server_spec, omp_env, peer_record,
                             vllm_python)
from eval.composition import load_system_config
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.family import load_family
from orchestrator.core.router import Router
from orchestrator.core.types import MemberName, Request, RequestId, RequestOutput, SamplingParams

REPO = Path(__file__).resolve().parent.parent
FAMILY = load_family("tiny")
CONFIG = load_system_config({"pool.num_pages": 512})
LIMITS = {"tiny-s": 736, "tiny-m": 576, "tiny-l": 480}
# complexities inside each member's band (router.complexity_thresholds 0.4, 0.7)
EASY, MIDDLE, HARD = 0.1, 0.5, 0.9


def request(prompt_len: int, max_tokens: int = 64, complexity: float | None = None, session: str | None = None,
            pinned: str | None = None, rid: str = "r") -> Request:
    return Request(request_id=RequestId(rid), prompt_token_ids=[5] * prompt_len,
                   sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0), arrival_s=0.0,
                   session_id=session, pinned_member=None if pinned is None else MemberName(pinned),
                   complexity_hint=complexity)


class Scores:
    """An estimator that scores a prompt by its first token (tests choose the complexity through the prompt)."""

    def score(self, ids) -> float:
        return {1: EASY, 2: MIDDLE, 3: HARD}[ids[0]]


def balancer(kind: str) -> ComplexityBalancer:
    return make_balancer(kind, Router(FAMILY, CONFIG.router), Scores(), LIMITS)


# ----------------------------------------------------------------------------- balancers (pure)
def test_the_simple_balancer_routes_each_turn_by_the_cores_adequate_member():
    b, router = balancer("complexity"), Router(FAMILY, CONFIG.router)
    assert isinstance(b, ComplexityBalancer) and not isinstance(b, StickyBalancer)
    for complexity in (EASY, MIDDLE, HARD, 0.0, 0.4, 0.7, 1.0):
        decision = b.route(request(100, complexity=complexity))
        assert decision.member == router.adequate_member(complexity) and decision.rerouted_from is None
    # without a hint: the estimator's score of the prompt, as the core's scheduler reads it
    prompt = [3] + [5] * 99
    r = Request(RequestId("x"), prompt, SamplingParams(max_tokens=8), 0.0)
    assert b.complexity(r) == HARD and b.route(r).member == "tiny-l"
    # the same session's turns each go by their own complexity
    assert [b.route(request(100, complexity=c, session="s")).member for c in (HARD, EASY, MIDDLE)] == \
        ["tiny-l", "tiny-s", "tiny-m"]


def test_a_server_too_small_passes_the_request_up_else_down_else_refuses():
    b = balancer("complexity")
    # max_model_len: tiny-s 736, tiny-m 576, tiny-l 480 (prompt + max_tokens must fit)
    assert b.route(request(600, 64, EASY)).member == "tiny-s"
    up = b.route(request(500, 64, MIDDLE))            # 564 <= 576: tiny-m holds it
    assert up.member == "tiny-m" and up.rerouted_from is None
    moved = b.route(request(540, 64, HARD))           # 604 > 480 (tiny-l) and > 576 (tiny-m): down to tiny-s
    assert moved.member == "tiny-s" and moved.rerouted_from == "tiny-l" and "re-routed" in moved.reason
    moved = b.route(request(450, 64, EASY))            # 514 <= 736: tiny-s itself
    assert moved.member == "tiny-s" and moved.rerouted_from is None
    up = b.route(request(460, 64, HARD))                # 524 > 480: the largest smaller that holds: tiny-m
    assert up.member == "tiny-m" and up.rerouted_from == "tiny-l"
    assert b.num_reroutes == 2
    with pytest.raises(InvalidRequestError):
        b.route(request(700, 64, EASY))                 # 764 > every server's max_model_len
    # a pinned request goes to its member's server unchecked (warm-up and probes)
    assert b.route(request(4, 48, pinned="tiny-l")).member == "tiny-l"


def test_the_sticky_balancer_keeps_a_session_on_its_first_server_while_it_holds_it():
    b = balancer("sticky")
    assert isinstance(b, StickyBalancer)
    first = b.route(request(100, complexity=HARD, session="a"))
    assert first.member == "tiny-l"
    later = b.route(request(150, complexity=EASY, session="a"))
    assert later.member == "tiny-l" and "session kept on tiny-l" in later.reason
    too_long = b.route(request(450, complexity=EASY, session="a"))   # 514 > 480: tiny-l cannot hold it
    assert too_long.member == "tiny-s"
    assert b.route(request(200, complexity=MIDDLE, session="a")).member == "tiny-l"   # home unchanged
    # another session has its own home; no session: as the simple balancer
    assert b.route(request(100, complexity=EASY, session="b")).member == "tiny-s"
    assert b.route(request(100, complexity=HARD, session="b")).member == "tiny-s"
    assert b.route(request(100, complexity=HARD)).member == "tiny-l"
    # a first turn placed away from its routed member makes the placed server the home
    c = b.route(request(500, complexity=HARD, session="c"))
    assert c.member == "tiny-m" and b.route(request(10, complexity=EASY, session="c")).member == "tiny-m"


def test_the_balanced_engine_sends_each_request_to_its_members_server_by_name():
    class Recorder:
        def __init__(self, member):
            self.member, self.calls = member, []

        async def generate(self, request, model=None, route=None):
            self.calls.append((request.request_id, model, route.member))
            yield RequestOutput(request.request_id, [7], [], [], MemberName(self.member), finished=True)

    engines = {m: Recorder(m) for m in FAMILY.serving_names}
    front = BalancedEngine(balancer("sticky"), engines)

    async def send(r):
        return [out async for out in front.generate(r)]

    asyncio.run(send(request(100, complexity=HARD, session="s", rid="t0")))
    asyncio.run(send(request(100, complexity=EASY, session="s", rid="t1")))
    asyncio.run(send(request(100, complexity=EASY, rid="t2")))
    assert engines["tiny-l"].calls == [("t0", "tiny-l", "tiny-l"), ("t1", "tiny-l", "tiny-l")]
    assert engines["tiny-s"].calls == [("t2", "tiny-s", "tiny-s")]
    assert front.stats() == {"counters": {"reroutes": 0}}
    with pytest.raises(ValueError):
        make_balancer("round-robin", Router(FAMILY, CONFIG.router), Scores(), LIMITS)


# ----------------------------------------------------------------------------- KV split and servers' flags
def test_the_servers_share_mfss_arena_as_whole_blocks_by_weight_bytes():
    total = arena_bytes(CONFIG)
    assert total == 512 * CONFIG.pool.page_bytes
    fractions = proportional_split(FAMILY)
    shares = kv_shares(FAMILY, total, fractions, BLOCK_TOKENS, "float32")
    assert list(shares) == list(FAMILY.serving_names)
    for member, share in shares.items():
        spec = FAMILY.member(member)
        assert share.bytes_per_token == 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
        block = BLOCK_TOKENS * share.bytes_per_token
        assert share.kv_bytes == share.num_blocks * block
        assert 0 <= fractions[member] * total - share.kv_bytes < block        # short of its share by < 1 block
        assert share.max_model_len == min(spec.context_tokens, (share.num_blocks - 1) * BLOCK_TOKENS)
    given = sum(s.kv_bytes for s in shares.values())
    assert given <= total and total - given < sum(BLOCK_TOKENS * s.bytes_per_token for s in shares.values())
    # the tiny family at 512 pages of 16 KiB (8 MiB): 24, 19 and 16 blocks of 32 tokens
    assert [s.num_blocks for s in shares.values()] == [24, 19, 16]
    assert [s.max_model_len for s in shares.values()] == [736, 576, 480]
    # half precision: twice the tokens in the same bytes (the context caps tiny-s)
    half = kv_shares(FAMILY, total, fractions, BLOCK_TOKENS, "float16")
    assert [s.num_blocks for s in half.values()] == [48, 38, 32]
    record = peer_record("0.32.0", shares, total, [], 1, "nobind")
    assert record["total_kv_bytes"] == total and record["kv_bytes_given"] == given
    assert record["shares"]["tiny-l"]["kv_bytes"] == shares["tiny-l"].kv_bytes
    with pytest.raises(ValueError, match="at least 2"):
        kv_shares(FAMILY, 16 * CONFIG.pool.page_bytes, fractions)
    with pytest.raises(ValueError):
        kv_shares(FAMILY, total, {"tiny-s": 0.5, "tiny-l": 0.5})


def test_each_server_gets_its_share_prefix_caching_and_its_threads():
    share = KVShare("tiny-m", 0.3, 4096, 32, 19, 19 * 32 * 4096, 576)
    spec = member_server_spec(FAMILY, share, 1, 8123, Path("/venv/bin/python"), "float32", 1, "nobind",
                              ["--max-num-seqs", "64"])
    argv = spec.argv
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(share.kv_bytes)
    assert argv[argv.index("--max-model-len") + 1] == "576" and argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--model") + 1] == str(FAMILY.member("tiny-m").checkpoint_dir)
    assert argv[argv.index("--served-model-name") + 1] == "tiny-m" and argv[argv.index("--port") + 1] == "8123"
    assert "--enable-prefix-caching" in argv and "--enable-prompt-tokens-details" in argv
    assert argv[-2:] == ["--max-num-seqs", "64"]
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] is None          # removed: it would override the bytes given
    assert spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and spec.env["OMP_NUM_THREADS"] == "1"
    assert omp_env(0, 1, "spread", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert omp_env(1, 1, "spread", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert omp_env(2, 1, "spread", [0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert omp_env(1, 2, "spread", [4, 5, 6]) == {"VLLM_CPU_OMP_THREADS_BIND": "6,4"}
    with pytest.raises(ValueError):
        omp_env(0, 1, "auto")


# ----------------------------------------------------------------------------- the curve against a named baseline
def test_knee_capacity_and_intervals_read_against_the_results_baseline_system():
    from eval.bench.curve import summarize_curve
    from eval.bench.intervals import resummarize
    from eval.bench.result import rate_point

    def metrics(latency, ttft, tpot):
        return {"mean_token_latency_s": latency, "ttft_p50_s": ttft, "ttft_p90_s": ttft, "tpot_p50_s": tpot,
                "tpot_p90_s": tpot}

    grid = [(0.5, 1.0, 0.8), (1.0, 1.5, 0.9), (2.0, 3.0, 1.5)]           # rate, peer latency, mfs latency
    curve = [rate_point(r, {}, {"mfs": metrics(m, 0.1 * m, m), "vllm_per_member": metrics(v, 0.1 * v, v)},
                        "vllm_per_member") for r, v, m in grid]
    assert curve[0]["reductions_vs_baseline"] == {"mfs": pytest.approx(0.2)}
    summary = summarize_curve(curve, None, "vllm_per_member")
    assert 1.0 < summary["knee_rate"] < 2.0 and summary["reduction_at_knee"] > 0
    assert summarize_curve(curve, None)["knee_rate"] is None          # no system named "baseline"
    result = {"curve": curve, "settings": {"slo_ttft_x": 5.0, "slo_tpot_x": 2.0}, "baseline_system": "vllm_per_member"}
    again = resummarize(result)
    assert again["knee_rate"] == summary["knee_rate"] and again["capacity_at_slo"]["mfs"] >= \
        again["capacity_at_slo"]["vllm_per_member"] > 0


# ----------------------------------------------------------------------------- the HTTP engine against `mfs serve`
@pytest.fixture(scope="module")
def mfs_server(tmp_path_factory):
    from eval.bench.peer import mfs_server_spec
    from eval.bench.servers import free_port, launch, shut_down, wait_ready

    tmp = tmp_path_factory.mktemp("mfs-serve")
    port = free_port()
    overrides = {"pool.num_pages": 512, "pool.host_tier_mb": 0.0, "pool.disk_tier_mb": 0.0, "engine.num_threads": 1}
    server = launch(mfs_server_spec(REPO / "engines/families/tiny", port, overrides, tmp / "mfs.yaml"), port, tmp)
    try:
        asyncio.run(wait_ready(server.base_url, server.proc, 240))
        yield server
    finally:
        shut_down(server)
        assert server.proc.poll() is not None


def test_the_http_engine_streams_exact_token_ids_from_mfs_serve(mfs_server):
    import httpx

    from eval.bench.http_engine import HttpEngine
    from orchestrator.core.types import FinishReason

    prompt = [1] + list(range(40, 90))
    r = Request(RequestId("h0"), prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), 0.0,
                session_id="sess-1", pinned_member=MemberName("tiny-m"))

    async def stream():
        async with HttpEngine(mfs_server.base_url, "tiny") as engine:
            return [out async for out in engine.generate(r)]

    outs = asyncio.run(stream())
    ids = [t for out in outs for t in out.new_token_ids]
    final = outs[-1]
    assert len(ids) == 12 and final.finished and final.finish_reason is FinishReason.LENGTH and final.error is None
    assert final.num_prompt_tokens == len(prompt) and sum(s.num_tokens for s in final.spans) == 12
    assert all(out.member == "tiny-m" for out in outs)
    # the same greedy request without streaming: the same ids (vLLM's return_token_ids, honoured by mfs serve)
    body = {"model": "tiny-m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    answer = httpx.post(mfs_server.base_url + "/v1/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["token_ids"] == ids and answer["choices"][0]["prompt_token_ids"] == prompt
    chat = {"model": "tiny-m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    answer = httpx.post(mfs_server.base_url + "/v1/chat/completions", json=chat, timeout=60).json()
    assert len(answer["choices"][0]["token_ids"]) == 3 and answer["prompt_token_ids"][0] == 1   # beside the choices


def test_the_bench_replay_runs_closed_loop_sessions_over_http(mfs_server):
    from eval.bench.driver import measure_engine, probe_stream_step_s
    from eval.bench.http_engine import HttpEngine
    from eval.workloads import Session, Trace, Turn, WorkloadSpec

    first = [1] + list(range(100, 180))
    turns = [Turn(first, 8, 0.0, first), Turn(first + [9, 9], 6, 0.01, [300, 301, 302])]
    trace = Trace(spec=WorkloadSpec(num_sessions=2, lengths="exact"),
                  sessions=[Session("s0", "multiturn", "c0", turns),
                            Session("s1", "short", "c1", [Turn([1, 50, 51, 52], 5, 0.0, [1, 50, 51, 52])])],
                  arrival_times_s=[0.0, 0.01])

    async def run():
        async with HttpEngine(mfs_server.base_url, "tiny") as engine:
            return await measure_engine(engine, list(FAMILY.serving_names), trace, "http", probe=probe_stream_step_s)

    records, metrics = asyncio.run(run())
    assert len(records) == 3 and all(r.ok for r in records) and metrics["num_failed"] == 0
    s0 = [r for r in records if r.session_id == "s0"]
    assert [r.output_tokens for r in s0] == [8, 6]
    # closed loop: the second prompt is the first prompt, the reply as generated, then the user's part
    assert s0[1].prompt_token_ids == first + s0[0].output_token_ids + [300, 301, 302]
    assert s0[1].prompt_tokens == len(s0[1].prompt_token_ids) and s0[1].cached_tokens > 0
    assert set(metrics["solo_decode_step_s"]) == set(FAMILY.serving_names)
    assert all(v > 0 for v in metrics["solo_decode_step_s"].values())


# ----------------------------------------------------------------------------- eval's compared systems over HTTP
def compared_config(name: str = "baseline", family: str = "tiny", num_pages: int = 512):
    """A compared system as the peer bench composes it: MFS's arena without tiers, split as the vLLM servers are."""
    from eval.bench.peer import MFS_NO_TIERS
    from eval.systems import system_config

    fractions = proportional_split(load_family(family))
    return system_config(name, family, num_pages, fractions, {**MFS_NO_TIERS, "engine.num_threads": 1}, fractions)


def test_a_compared_system_is_the_peers_arena_and_split_and_its_server_reads_it_back(tmp_path):
    from eval.bench.peer import compared_server_spec
    from eval.bench.peer_bench import PeerSettings, peer_settings
    from eval.bench.serve_system import build_parser, mfs_part
    from eval.composition import SystemConfig
    from orchestrator.core.config import load_config

    config = compared_config()
    assert config.comparison.static_split == proportional_split(FAMILY) and config.pool.num_pages == 512
    assert config.pool.host_tier_mb == 0 and config.pool.disk_tier_mb == 0 and not config.speculation.enabled
    assert not config.comparison.cross_member_sharing and config.router.sticky_sessions
    elastic = compared_config("baseline_elastic")
    assert elastic.comparison.static_split is None and not elastic.comparison.use_affinity
    spec = compared_server_spec("baseline", config, 8125, tmp_path / "baseline.yaml")
    argv = spec.argv
    assert argv[1:3] == ["-m", "eval.bench.serve_system"] and argv[argv.index("--system") + 1] == "baseline"
    assert argv[argv.index("--port") + 1] == "8125" and argv[argv.index("--max-client-requests") + 1] == "0"
    assert load_config(argv[argv.index("--config") + 1], cls=SystemConfig) == config    # the file is the config
    assert "comparison" not in mfs_part(config) and load_config(None, None).family == mfs_part(config)["family"]
    assert build_parser().parse_args(["--system", "baseline_elastic", "--config", "x"]).port == 8000
    args = argparse.Namespace(peer="vllm", peer_systems="mfs,baseline,baseline_elastic", peer_python=None,
                              peer_threads=1, peer_bind="nobind", peer_block_size=32, peer_arg=[])
    assert peer_settings(args).systems == ("mfs", "baseline", "baseline_elastic")        # no vLLM venv needed
    assert PeerSettings().systems == ("mfs", "vllm_per_member", "vllm_per_member_sticky")
    with pytest.raises(SystemExit, match="known are"):
        peer_settings(argparse.Namespace(**{**vars(args), "peer_systems": "mfs,baseline_spec"}))


@pytest.fixture(scope="module")
def baseline_server(tmp_path_factory):
    """`baseline` (separate deployments of the tiny family on static slices) served by `mfs serve`'s server."""
    import psutil

    from eval.bench.peer import compared_server_spec
    from eval.bench.servers import free_port, launch, shut_down, wait_ready

    tmp = tmp_path_factory.mktemp("baseline-serve")
    port = free_port()
    server = launch(compared_server_spec("baseline", compared_config(), port, tmp / "baseline.yaml"), port, tmp)
    children = []
    try:
        asyncio.run(wait_ready(server.base_url, server.proc, 240))
        children = psutil.Process(server.proc.pid).children(recursive=True)
        yield server
    finally:
        shut_down(server)
        assert server.proc.poll() is not None
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"the engine process outlived its server: {alive}"


def test_a_baseline_server_routes_the_family_and_shares_no_kv_across_members(baseline_server, mfs_server):
    import httpx
    import openai

    client = openai.OpenAI(base_url=baseline_server.base_url + "/v1", api_key="none")
    reply = client.completions.create(model="tiny", prompt="Explain prefix caching.", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True}, extra_headers={"X-Session-ID": "o1"})
    assert reply.model in FAMILY.serving_names and reply.usage.completion_tokens == 4
    assert reply.mfs["route"]["reason"].startswith("complexity")        # the deployments' rule: complexity first
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert chat.model in FAMILY.serving_names and chat.usage.completion_tokens == 3
    stats = httpx.get(baseline_server.base_url + "/v1/stats", timeout=30).json()
    assert stats["engine"]["process"] == "separate" and stats["pages"]["total"] == 512    # as `mfs serve` runs MFS

    def cached(url: str, member: str, prompt: list[int]) -> int:
        body = {"model": member, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

    # the nested family: tiny-s's layers are tiny-l's lower ones. MFS reuses tiny-l's pages for tiny-s; the
    # separate deployments (per-member lineages) do not, and each still caches its own prefixes
    prompt = [1] + list(range(200, 264))
    assert cached(mfs_server.base_url, "tiny-l", prompt) == 0 and cached(mfs_server.base_url, "tiny-s", prompt) > 0
    assert cached(baseline_server.base_url, "tiny-l", prompt) == 0
    assert cached(baseline_server.base_url, "tiny-s", prompt) == 0
    assert cached(baseline_server.base_url, "tiny-s", prompt) > 0


def test_the_peer_benchs_replay_runs_closed_loop_sessions_on_a_baseline_server(baseline_server):
    from eval.bench.peer_bench import replay_system
    from eval.workloads import Session, Trace, Turn, WorkloadSpec

    first = [1] + list(range(100, 180))
    trace = Trace(spec=WorkloadSpec(num_sessions=1, lengths="exact"),
                  sessions=[Session("s0", "multiturn", "c0", [Turn(first, 8, 0.0, first),
                                                              Turn(first + [9, 9], 6, 0.01, [300, 301, 302])])],
                  arrival_times_s=[0.0])
    records, metrics = asyncio.run(replay_system("baseline", trace, FAMILY, {"baseline": baseline_server.base_url},
                                                 None))
    assert [r.output_tokens for r in records] == [8, 6] and all(r.ok for r in records)
    assert metrics["num_failed"] == 0 and records[1].cached_tokens > 0       # the session stayed on its member
    assert records[1].prompt_token_ids == first + records[0].output_token_ids + [300, 301, 302]


def test_the_peer_bench_runs_compared_systems_without_vllm_on_the_separate_weight_family(tmp_path):
    """`--peer-systems mfs,baseline` needs no vLLM venv; tiny-sep (separate weights) as the family. Smallest
    settings, a behaviour check only."""
    import psutil

    out = tmp_path / "peer.json"
    done = subprocess.run([sys.executable, "-m", "orchestrator.serve.cli", "bench", "--peer", "vllm", "--family",
                           "tiny-sep", "--quick", "--peer-systems", "mfs,baseline", "--sessions", "2", "--rates", "1",
                           "--no-quality", "--no-progress", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
                          env={**os.environ, "MFS_VLLM_PYTHON": str(tmp_path / "no-vllm" / "python")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["systems"]) == ["mfs", "baseline"] and result["baseline_system"] == "baseline"
    for name in ("mfs", "baseline"):
        m = result["systems"][name]
        assert m["num_requests"] > 0 and m["num_failed"] == 0
        assert set(m["requests_by_member"]) <= {"sep-s", "sep-m", "sep-l"}
    settings = result["settings"]
    baseline = settings["configs"]["baseline"]
    assert baseline["family"] == "tiny-sep" and baseline["pool"]["num_pages"] == settings["configs"]["mfs"]["pool"][
        "num_pages"] == 512
    assert baseline["pool"]["host_tier_mb"] == baseline["pool"]["disk_tier_mb"] == 0
    assert baseline["comparison"]["static_split"] == settings["baseline_split"]
    assert settings["peer"]["software"] == "vllm-cpu not run"
    assert any(n.startswith("baseline: eval's separate deployments") for n in result["notes"])
    for proc in psutil.process_iter(["cmdline"]):     # no server outlived the run (and its config file)
        cmdline = proc.info["cmdline"] or []
        if "eval.bench.serve_system" in cmdline and "--config" in cmdline:
            assert Path(cmdline[cmdline.index("--config") + 1]).exists(), cmdline


# ----------------------------------------------------------------------------- smoke run against vLLM-CPU
def vllm_installed() -> bool:
    from eval.bench.peer import vllm_version

    try:
        return vllm_python().is_file() and bool(vllm_version(vllm_python()))
    except (OSError, RuntimeError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not vllm_installed(), reason="vLLM-CPU's venv is missing: build it with `make vllm-venv`")
def test_a_smoke_run_against_one_vllm_cpu_server_per_member(tmp_path):
    import psutil

    out = tmp_path / "peer.json"
    systems = ["mfs", "baseline", "vllm_per_member", "vllm_per_member_sticky"]     # ours and theirs, one harness
    done = subprocess.run([sys.executable, "-m", "orchestrator.serve.cli", "bench", "--peer", "vllm", "--quick",
                           "--sessions", "2", "--rate", "1", "--no-quality", "--no-progress", "--out", str(out),
                           "--peer-systems", ",".join(systems)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert list(result["systems"]) == systems and result["baseline_system"] == "vllm_per_member"
    for key in ("curve", "rates", "knee_rate", "reductions_at_knee", "capacity_at_slo", "capacity_ratio", "slo",
                "reductions_vs_baseline", "paired_vs_baseline", "headline_rate"):
        assert key in result
    assert [p["rate"] for p in result["curve"]] == [1.0]
    for name in systems:
        m = result["systems"][name]
        assert m["num_requests"] > 0 and m["num_failed"] == 0 and m["mean_token_latency_s"] > 0
    assert set(result["systems"]["vllm_per_member"]["requests_by_member"]) <= set(FAMILY.serving_names)
    # the baseline's slices are the vLLM servers' fractions of the same arena
    assert result["settings"]["configs"]["baseline"]["comparison"]["static_split"] == \
        {m: s["fraction"] for m, s in result["settings"]["peer"]["shares"].items()}
    peer = result["settings"]["peer"]
    assert peer["software"].startswith("vllm-cpu ") and peer["total_kv_bytes"] == 512 * 16384
    assert peer["kv_bytes_given"] == sum(s["kv_bytes"] for s in peer["shares"].values()) <= peer["total_kv_bytes"]
    for member, share in peer["shares"].items():
        argv = peer["servers"][f"vllm-{member}"]["argv"]
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(share["kv_bytes"])
    # the servers are gone: no process still serves on their ports
    ports = {peer["servers"][s]["argv"][peer["servers"][s]["argv"].index("--port") + 1] for s in peer["servers"]}
    time.sleep(1)
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        assert not ("vllm.entrypoints.openai.api_server" in cmdline and "--port" in cmdline
                    and cmdline[cmdline.index("--port") + 1] in ports), cmdline
