"""MFS routing over Triton in its own process: the child side of `ProcessServing` for engine.kind 'triton'.

Why: with TensorRT-LLM members the orchestrator's work is routing, the token rules (stop, hold-back, confidence,
hand-over) and the prefix estimate, per streamed token; in the HTTP process that Python shares the GIL with
parsing, SSE writing and detokenizing. Here TritonServing runs on an event loop of its own in a child process
(the same split as the local engine's, orchestrator/serve/engine_process.py); the HTTP process only streams.

It speaks engine_process's pipe protocol unchanged: ("health", bool) whenever Triton's readiness as
TritonServing sees it changes (a Triton outage turns /health 503 in the HTTP process), ("tick",) every second
while its loop goes round. Outputs produced during one turn of the child's loop leave in one ("out", [...])
message.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import signal
import threading

from orchestrator.core.config import MFSConfig
from orchestrator.core.types import Request, RequestId
from orchestrator.serve.engine_process import TICK_S, out_message
from orchestrator.serve.output_stream import Item, StepOutputs

log = logging.getLogger("mfs.triton_process")
_HEALTH_POLL_S = 0.1          # how often readiness is compared with what the HTTP process last heard


def triton_main(config: MFSConfig, conn) -> None:
    """The child: TritonServing on its own event loop, driven by the pipe. Signals are the parent's business
    (it drains, then sends "stop"); a closed pipe ends it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(_TritonChild(config, conn).run())
    except (EOFError, OSError, KeyboardInterrupt):
        pass                  # the parent is gone


class _TritonChild:
    def __init__(self, config: MFSConfig, conn):
        self.config = config
        self.conn = conn
        self.serving = None
        self.outputs: StepOutputs[RequestId] = StepOutputs(lambda items: conn.send(out_message(items)))
        self.tasks: dict[RequestId, asyncio.Task] = {}
        self.stopped: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False
        self._reported_health: bool | None = None

    async def run(self) -> None:
        from orchestrator.serve.triton_serving import TritonServing

        self.loop = asyncio.get_running_loop()
        self.stopped = asyncio.Event()
        try:
            self.serving = TritonServing(self.config)
            await self.serving.start()       # Triton may still be down: the probe keeps trying
        except Exception as exc:  # the parent reports it and exits
            self.conn.send(("failed", f"{type(exc).__name__}: {exc}"))
            return
        self.conn.send(("ready", None))
        self._report_health()
        threading.Thread(target=self._read_pipe, name="mfs-triton-pipe", daemon=True).start()
        health = asyncio.create_task(self._watch_health(), name="mfs-triton-health")
        try:
            await self.stopped.wait()
        finally:
            health.cancel()
            await self.serving.stop(0.0)     # the parent drained already; what is left is cancelled
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    # ------------------------------------------------------------------ pipe -> loop
    def _read_pipe(self) -> None:
        """Blocking reads on a thread of their own; each command runs on the loop."""
        try:
            while True:
                message = self.conn.recv()
                self.loop.call_soon_threadsafe(self.handle, message)
                if message[0] == "stop":
                    return
        except (EOFError, OSError):
            self.loop.call_soon_threadsafe(self.stopped.set)
        except RuntimeError:      # the loop closed first
            pass

    def handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            request: Request = message[1]
            self.tasks[request.request_id] = asyncio.create_task(self._serve(request))
        elif kind == "abort":
            self.serving.abort(message[1], finish_reason=message[2])
        elif kind == "abort_all":
            for request_id in list(self.tasks):
                self.serving.abort(request_id)
        elif kind == "stats":
            self.outputs.flush()             # outputs before the reply: the ordering promise
            self.conn.send(("stats", message[1], self.serving.stats()))
        elif kind == "stop":
            self.stopped.set()

    async def _serve(self, request: Request) -> None:
        request_id = request.request_id
        try:
            async for output in self.serving.generate(request):
                self._put(request_id, output)
        except Exception as exc:  # QueueFull, Triton down, a failed stream: the stream's last item
            self._put(request_id, exc)
        finally:
            self.tasks.pop(request_id, None)

    # ------------------------------------------------------------------ loop -> pipe
    def _put(self, request_id: RequestId, item: Item) -> None:
        self.outputs.put(request_id, item)
        if not self._flush_scheduled:          # one message for everything this turn of the loop produced
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        self.outputs.flush()

    def _report_health(self) -> None:
        ready = self.serving.is_ready()
        if ready != self._reported_health:
            self._reported_health = ready
            self.conn.send(("health", ready))

    async def _watch_health(self) -> None:
        for turn in itertools.count(1):
            await asyncio.sleep(_HEALTH_POLL_S)
            self._report_health()
            if turn % round(TICK_S / _HEALTH_POLL_S) == 0:
                self.conn.send(("tick",))        # the loop goes round (the HTTP side's stall check)
