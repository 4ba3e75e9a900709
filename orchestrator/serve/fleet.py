"""`mfs fleet`: many `mfs serve` replicas behind the SGLang Model Gateway (sglang-router), one URL in front.

  mfs fleet up --replicas N [--config FILE] [--policy sticky|cache_aware|round_robin] [--port 8000]
  mfs fleet --worker-urls URL [URL ...] [--policy ...] [--port 8000]      (replicas started elsewhere)

This module owns the processes: it starts the replicas (`up` only), the gateway(s) and the fleet front
(fleet_edge, in this process), waits for each to be healthy within a bound, restarts a child that dies (after
--restart-delay-s; the gateway's health checks take the node out and put it back), and on Ctrl-C/SIGTERM stops
everything: every child runs in its own process group, is stopped by group (SIGTERM, then SIGKILL after
--grace-s), and also gets SIGTERM from the kernel if this process dies first (PR_SET_PDEATHSIG), so nothing is
orphaned. Ports: front PORT; replicas PORT+1..PORT+N; cache-aware gateway PORT+N+1, sticky gateway PORT+N+2;
their Prometheus endpoints PORT+N+3, PORT+N+4. `<log-dir>/fleet.json` lists every URL and pid.
"""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from orchestrator.serve.client_limits import header_limited_protocol
from orchestrator.serve.fleet_edge import FleetFront, FrontSettings
from orchestrator.serve.optional import install_hint

log = logging.getLogger("mfs.fleet")
POLICIES = ("sticky", "cache_aware", "round_robin")   # round_robin: a cache-blind baseline for comparisons
MISSING_GATEWAY = ("mfs fleet: the SGLang Model Gateway is not installed; "
                   f"`{install_hint('fleet')}` (package sglang-router)")


@dataclass(slots=True)
class Child:
    """One supervised process: a replica or a gateway."""
    name: str
    cmd: list[str]
    log_path: Path
    health_url: str
    proc: subprocess.Popen | None = None
    restart_at_s: float | None = None
    num_restarts: int = 0

    def start(self) -> None:
        log_file = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        finally:
            log_file.close()
        self.restart_at_s = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        """SIGTERM to the child's whole process group (its graceful path)."""
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def reap(self, deadline_s: float) -> None:
        """Waits for the child until deadline_s (monotonic), then SIGKILL to its group (whatever is left)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=max(0.0, deadline_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s outlived its SIGTERM grace: SIGKILL", self.name)
        _signal_group(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not exit after SIGKILL", self.name, self.proc.pid)

    def log_tail(self, num_lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except OSError:
            return ""


def stop_all(groups: list[list[Child]], grace_s: float) -> None:
    """Group by group (gateways first, so no new request reaches a stopping replica), in parallel inside a group."""
    for group in groups:
        for child in group:
            child.terminate()
        deadline_s = time.monotonic() + grace_s
        for child in group:
            child.reap(deadline_s)


@dataclass(slots=True)
class FleetPlan:
    """Every process and URL of one fleet, decided before anything starts."""
    host: str
    front_port: int
    worker_urls: list[str]
    replicas: list[Child] = field(default_factory=list)
    gateways: dict[str, Child] = field(default_factory=dict)        # by policy: cache_aware/round_robin, sticky
    gateway_urls: dict[str, str] = field(default_factory=dict)
    gateway_metrics_urls: dict[str, str] = field(default_factory=dict)

    def describe(self) -> dict:
        return {"front": f"http://{self.host}:{self.front_port}", "replicas": self.worker_urls,
                "gateways": self.gateway_urls, "gateway_metrics": self.gateway_metrics_urls,
                "pids": {c.name: c.proc.pid for c in [*self.replicas, *self.gateways.values()] if c.proc}}


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends SIGTERM if `mfs fleet` dies (even by SIGKILL)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))   # 1 = PR_SET_PDEATHSIG (Linux)
    except (OSError, AttributeError):
        pass                                                               # not Linux: process groups still apply


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def gateway_command(args: argparse.Namespace, port: int, metrics_port: int, policy: str,
                    worker_urls: list[str]) -> list[str]:
    """sglang-router launch line. Health checks every second so a lost node leaves within ~2 s; retries with a
    backoff longer than that, so a request that meets the dead node before the health check is re-routed."""
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(port),
           "--worker-urls", *worker_urls, "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
           "--health-check-endpoint", "/health", "--health-check-interval-secs", str(args.health_interval_s),
           "--health-check-timeout-secs", "2", "--health-failure-threshold", "2", "--health-success-threshold", "1",
           "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "5",
           "--retry-max-retries", "6", "--retry-initial-backoff-ms", "200", "--retry-max-backoff-ms", "2000",
           "--request-timeout-secs", str(int(args.request_timeout_s)), "--shutdown-grace-period-secs",
           str(int(args.grace_s)), "--worker-startup-timeout-secs", str(int(args.startup_timeout_s)),
           "--worker-startup-check-interval", "1", "--log-level", "warn"]
    if policy == "sticky":   # a new session goes to the replica with the fewest requests in flight
        cmd += ["--policy", "manual", "--assignment-mode", "min_load"]
    else:
        cmd += ["--policy", policy]
    return cmd


def replica_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "orchestrator.serve.cli", "serve", "--host", args.host, "--port", str(port),
           "--log-level", "warning", "--grace-s", str(args.grace_s)]
    for flag, value in (("--config", args.config), ("--family", args.family), ("--api-key", args.api_key)):
        if value:
            cmd += [flag, value]
    return cmd


def plan_fleet(args: argparse.Namespace, log_dir: Path) -> FleetPlan:
    host, port = args.host, args.port
    if args.worker_urls:
        worker_urls = [u.rstrip("/") for u in args.worker_urls]
        num_replicas = len(worker_urls)
    else:
        num_replicas = args.replicas
        worker_urls = [f"http://{host}:{port + 1 + i}" for i in range(num_replicas)]
    plan = FleetPlan(host=host, front_port=port, worker_urls=worker_urls)
    if not args.worker_urls:
        for i in range(num_replicas):
            plan.replicas.append(Child(f"replica-{i + 1}", replica_command(args, port + 1 + i),
                                       log_dir / f"replica-{i + 1}.log", f"{worker_urls[i]}/health"))
    policies = ["cache_aware", "sticky"] if args.policy == "sticky" else [args.policy]
    for j, policy in enumerate(policies):
        gw_port, metrics_port = port + num_replicas + 1 + j, port + num_replicas + 3 + j
        plan.gateway_urls[policy] = f"http://{host}:{gw_port}"
        plan.gateway_metrics_urls[policy] = f"http://{host}:{metrics_port}/metrics"
        plan.gateways[policy] = Child(f"gateway-{policy}", gateway_command(args, gw_port, metrics_port, policy,
                                                                            worker_urls),
                                      log_dir / f"gateway-{policy}.log", f"{plan.gateway_urls[policy]}/health")
    return plan


async def wait_healthy(children: list[Child], timeout_s: float) -> None:
    """Every child answers 200 on its health URL within timeout_s, or RuntimeError naming the first that did not."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    async with httpx.AsyncClient(timeout=2.0) as client:
        while pending:
            for child in list(pending):
                if not child.alive():
                    raise RuntimeError(f"{child.name} exited (rc {child.proc.returncode}) while starting; "
                                       f"its log ({child.log_path}) ends:\n{child.log_tail()}")
                try:
                    if (await client.get(child.health_url)).status_code == 200:
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"{pending[0].name} not healthy after {timeout_s:.0f} s; its log ends:\n"
                                   f"{pending[0].log_tail()}")
            if pending:
                await asyncio.sleep(0.5)


async def wait_workers_healthy(gateway_urls: list[str], num_workers: int, timeout_s: float) -> None:
    """Each gateway reports num_workers healthy workers (its own health checks have passed) within timeout_s."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        for url in gateway_urls:
            while True:
                try:
                    workers = (await client.get(f"{url}/workers")).json().get("workers", [])
                    if sum(bool(w.get("is_healthy")) for w in workers) >= num_workers:
                        break
                except (httpx.HTTPError, ValueError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"gateway {url} does not see {num_workers} healthy workers "
                                       f"after {timeout_s:.0f} s")
                await asyncio.sleep(0.5)


async def supervise(children: list[Child], restart_delay_s: float | None, stopping: asyncio.Event,
                    on_restart=lambda: None) -> None:
    """Restarts a child that died (the gateway takes a dead replica out and puts it back when healthy)."""
    while not stopping.is_set():
        now = time.monotonic()
        for child in children:
            if child.alive() or child.proc is None:
                continue
            if child.restart_at_s is None:
                log.warning("%s exited (rc %s)%s", child.name, child.proc.returncode,
                            "" if restart_delay_s is None else f"; restarting in {restart_delay_s:.0f} s")
                child.restart_at_s = now + (restart_delay_s if restart_delay_s is not None else float("inf"))
            elif now >= child.restart_at_s:
                child.num_restarts += 1
                log.warning("%s: restart %d", child.name, child.num_restarts)
                child.start()
                on_restart()
        try:
            await asyncio.wait_for(stopping.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            pass


async def run_fleet(args: argparse.Namespace, plan: FleetPlan, log_dir: Path) -> int:
    keyless = next(iter(plan.gateway_urls))
    front = FleetFront(FrontSettings(keyless_gateway_url=plan.gateway_urls[keyless], keyless_gateway_name=keyless,
                                     sticky_gateway_url=plan.gateway_urls.get("sticky"),
                                     worker_urls=tuple(plan.worker_urls), request_timeout_s=args.request_timeout_s))
    # the request head's deadline and size, as mfs serve's (orchestrator/serve/client_limits.py)
    server = uvicorn.Server(uvicorn.Config(front, host=args.host, port=args.port, log_level="warning",
                                           lifespan="on", timeout_graceful_shutdown=int(args.grace_s) + 5,
                                           http=header_limited_protocol(10.0, 64 * 1024)))
    stopping = asyncio.Event()
    children = [*plan.replicas, *plan.gateways.values()]
    try:
        for child in plan.replicas:
            child.start()
        await wait_healthy(plan.replicas, args.startup_timeout_s)
        for child in plan.gateways.values():
            child.start()
        await wait_healthy(list(plan.gateways.values()), args.startup_timeout_s)
        if plan.replicas:                   # ours are up: the gateways must have taken them all in
            await wait_workers_healthy(list(plan.gateway_urls.values()), len(plan.replicas), args.startup_timeout_s)
        else:                               # replicas started elsewhere may be down: say so, serve the rest
            try:
                await wait_workers_healthy(list(plan.gateway_urls.values()), len(plan.worker_urls),
                                           args.startup_timeout_s)
            except RuntimeError as exc:
                print(f"mfs fleet: warning: {exc}; serving with the healthy ones", file=sys.stderr, flush=True)
        def write_plan() -> None:          # fleet.json: URLs and current pids (rewritten on every restart)
            (log_dir / "fleet.json").write_text(json.dumps(plan.describe(), indent=1))
        # fleet.json and the banner announce a fleet that answers: only once the front is listening
        # (CI caught a client that read fleet.json and connected before the bind).
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            if serving.done():
                await serving
                raise RuntimeError(f"the front did not start on {args.host}:{args.port}")
            await asyncio.sleep(0.05)
        write_plan()
        print(f"mfs fleet: http://{args.host}:{args.port}  ({len(plan.worker_urls)} replicas, policy {args.policy}; "
              f"Ctrl+C stops all)", flush=True)
        for url in plan.worker_urls:
            print(f"  replica {url}  (per-node /metrics, /v1/stats)", flush=True)
        for name, url in plan.gateway_urls.items():
            print(f"  gateway {name} {url}  (metrics {plan.gateway_metrics_urls[name]})", flush=True)
        print(f"  logs {log_dir}", flush=True)
        restart_delay_s = None if args.restart_delay_s < 0 else args.restart_delay_s
        watcher = asyncio.ensure_future(supervise(children, restart_delay_s, stopping, write_plan))
        await serving
        stopping.set()
        await watcher
        return 0
    except RuntimeError as exc:
        print(f"mfs fleet: {exc}", file=sys.stderr)
        return 1
    finally:
        stopping.set()
        for sig in (signal.SIGTERM, signal.SIGINT):   # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        stop_all([list(plan.gateways.values()), plan.replicas], args.grace_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", choices=["up"], help="`up`: start N local replicas (else: --worker-urls)")
    parser.add_argument("--replicas", type=int, default=2, help="replicas to start with `up` (default 2)")
    parser.add_argument("--worker-urls", nargs="+", help="replicas started elsewhere (instead of `up`)")
    parser.add_argument("--config", help="YAML config for each replica (docs/CONFIG.md)")
    parser.add_argument("--family", help="family for each replica (default: config)")
    parser.add_argument("--policy", choices=POLICIES, default="sticky",
                        help="sticky: sessions pinned to a replica, the rest cache-aware (default); "
                             "cache_aware: every request by the gateway's prefix tree; "
                             "round_robin: cache-blind, a baseline for comparisons")
    parser.add_argument("--host", default="127.0.0.1", help="bind address of every process (default loopback)")
    parser.add_argument("--port", type=int, default=8000, help="front port; the others follow it (default 8000)")
    parser.add_argument("--api-key", help="replicas require 'Authorization: Bearer KEY' (the gateway forwards it)")
    parser.add_argument("--log-dir", help="children's logs and fleet.json (default: a new temporary directory)")
    parser.add_argument("--health-interval-s", type=int, default=1, help="gateway health-check period (default 1)")
    parser.add_argument("--restart-delay-s", type=float, default=5.0,
                        help="restart a dead child after this long; negative: never (default 5)")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0, help="bound on each start-up wait")
    parser.add_argument("--request-timeout-s", type=float, default=600.0, help="bound on one request, end to end")
    parser.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM grace for each child")


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one line per forwarded request otherwise
    if importlib.util.find_spec("sglang_router") is None:
        print(MISSING_GATEWAY, file=sys.stderr)
        return 2
    if (args.action == "up") == bool(args.worker_urls):
        print("mfs fleet: give either `up --replicas N` or `--worker-urls URL ...`", file=sys.stderr)
        return 2
    if args.action == "up" and args.replicas < 1:
        print("mfs fleet: --replicas must be >= 1", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="mfs-fleet-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_fleet(args, log_dir)
    ports = [args.port] + [int(u.rsplit(":", 1)[1]) for u in plan.worker_urls if not args.worker_urls] + \
            [int(u.rsplit(":", 1)[1]) for u in plan.gateway_urls.values()] + \
            [int(u.rsplit(":", 1)[1].split("/")[0]) for u in plan.gateway_metrics_urls.values()]
    busy = [p for p in ports if not port_is_free(args.host, p)]
    if busy:
        print(f"mfs fleet: port(s) {busy} on {args.host} are in use; choose another --port", file=sys.stderr)
        return 2

    def interrupt(signum, frame):            # SIGTERM before the front is up: unwind through the finally
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupt)
    try:
        return asyncio.run(run_fleet(args, plan, log_dir))
    except KeyboardInterrupt:
        return 0
