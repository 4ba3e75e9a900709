"""Triton python-backend model: one family member on the local MFS engine, behind the tensorrt_llm tensor interface.

Copied into <repo>/<member>/1/model.py by build-engines --backend python. The Triton-facing class is a thin
binding over MemberWorker (no Triton imports), which runs the core's EngineCore step loop over the local
executor with every request pinned to this member and escalation off: one member per model, like
tensorrt_llm. It depends on the engine (engines.local) and the core only, never on the serving edge.
"""
from __future__ import annotations

import json
import math
import os
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

# The stub's embedded interpreter ignores PYTHONPATH: add it by hand so numpy, torch and the project import.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

import numpy as np  # noqa: E402

try:  # only importable inside the Triton python stub
    import triton_python_backend_utils as pb_utils
except ImportError:  # unit tests drive MemberWorker directly
    pb_utils = None

KV_METRIC_NAME = "nv_trt_llm_kv_cache_block_metrics"
KV_METRIC_HELP = "TRT LLM KV cache block metrics"
KV_BLOCK_TYPES = ("max", "free", "used", "tokens_per", "reused", "fraction")


@dataclass(slots=True)
class GenerationInputs:
    """One request's tensors, decoded (None = the optional input was not sent)."""

    token_ids: list[int]
    max_tokens: int
    end_id: int | None = None
    streaming: bool = False
    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 0.0
    seed: int | None = None
    return_log_probs: bool = False
    return_perf_metrics: bool = False


@dataclass(slots=True)
class Chunk:
    """What one response carries: new tokens (streaming) or all of them (non-streaming)."""

    token_ids: list[int]
    logprobs: list[float]
    num_cached_prompt_tokens: int
    final: bool
    error: str | None = None


def parse_inputs(get: Callable[[str], np.ndarray | None]) -> GenerationInputs:
    """get(name) returns the input's array or None; shapes follow tensorrt_llm ([1, n] ids, [1, 1] scalars)."""
    def scalar(name: str, default):
        value = get(name)
        return default if value is None or value.size == 0 else value.reshape(-1)[0].item()

    ids = get("input_ids")
    if ids is None:
        raise ValueError("input 'input_ids' is required")
    token_ids = [int(t) for t in ids.reshape(-1)]
    length = scalar("input_lengths", len(token_ids))
    if not 0 < length <= len(token_ids):
        raise ValueError(f"input 'input_lengths' = {length} does not fit {len(token_ids)} input_ids")
    max_tokens = int(scalar("request_output_len", 0))
    if max_tokens < 1:
        raise ValueError("input 'request_output_len' must be >= 1")
    seed = scalar("random_seed", None)
    return GenerationInputs(
        token_ids=token_ids[:length], max_tokens=max_tokens,
        end_id=None if get("end_id") is None else int(scalar("end_id", 0)),
        streaming=bool(scalar("streaming", False)), top_k=int(scalar("runtime_top_k", 0)),
        top_p=float(scalar("runtime_top_p", 1.0)), temperature=float(scalar("temperature", 0.0)),
        seed=None if seed is None else int(seed), return_log_probs=bool(scalar("return_log_probs", False)),
        return_perf_metrics=bool(scalar("return_perf_metrics", False)),
    )


@dataclass(slots=True)
class KVBlockStats:
    """The tensorrt_llm backend's KV block gauges for this member's own arena."""

    tokens_per_block: int
    num_layers: int
    reused_blocks_total: int = 0
    values: dict[str, float] = field(default_factory=dict)

    def update(self, engine_stats: dict) -> dict[str, float]:
        pages = engine_stats.get("pages", {})
        by_state = pages.get("by_state", {})
        # A block = one page per layer; cached (refcount 0) blocks are reusable AND allocatable, as in TRT-LLM.
        max_blocks = int(pages.get("total", 0)) // self.num_layers
        used = int(by_state.get("used", 0)) // self.num_layers
        self.values = {"max": max_blocks, "free": max(0, max_blocks - used), "used": used,
                       "tokens_per": self.tokens_per_block, "reused": self.reused_blocks_total,
                       "fraction": used / max_blocks if max_blocks else 0.0}
        return self.values


class MemberWorker:
    """One member on the local engine, driven by the core's EngineCore on its own engine thread; Triton-independent.

    Requests are pinned to this member and escalation is off (one member per model, like tensorrt_llm), so
    no routing decision is ever made here: the prompt's complexity is not scored (complexity_hint=0)."""

    def __init__(self, family_dir: str, member: str, num_pages: int, page_bytes: int, dtype: str):
        from orchestrator.core.config import load_config
        from orchestrator.core.family import dtype_bytes, load_family

        self.member = member
        self.family = load_family(family_dir)
        spec = self.family.member(member)
        self.config = load_config(overrides={
            "family": str(family_dir), "pool.num_pages": num_pages, "pool.page_bytes": page_bytes,
            "engine.kind": "local", "engine.device": "cpu", "engine.dtype": dtype, "engine.num_threads": 1,
            "escalation.enabled": False, "pool.host_tier_mb": 0.0,
        })
        self.kv = KVBlockStats(spec.tokens_per_block(page_bytes, dtype_bytes(dtype)), spec.num_layers)
        self.core = None
        self._running = False
        self._thread: threading.Thread | None = None
        # Responses go out on their own thread: a Triton send is IPC, and the engine thread must not wait on it.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name=f"mfs-{member}-send", daemon=True)

    def start(self) -> None:
        from engines.local.executor import LocalExecutor, executor_from_config
        from orchestrator.core.complexity import ComplexityEstimator
        from orchestrator.core.engine_core import EngineCore

        cfg = self.config

        def make_executor(family, num_pages: int, page_bytes: int) -> LocalExecutor:
            return executor_from_config(cfg, family, num_pages, page_bytes, device="cpu",
                                        num_threads=cfg.engine.num_threads,
                                        # auto = 1 here: Triton's own threads share the process
                                        parallel_forwards=cfg.developer.parallel_forwards or 1)
        self.core = EngineCore(cfg, self.family, clock=time.monotonic, estimator=ComplexityEstimator(()),
                               make_executor=make_executor)
        self._running = True
        self._thread = threading.Thread(target=self.core.run, args=(lambda: self._running,),
                                        name=f"mfs-{self.member}", daemon=True)
        self._thread.start()
        self._sender.start()

    def stop(self) -> None:
        if self.core is not None:
            self.core.abort_all("model unloading")
            deadline = time.monotonic() + 1.0
            while self.core.has_work() and time.monotonic() < deadline:
                time.sleep(0.02)
            self._running = False
            self.core.wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        self._outbox.put(None)
        if self._sender.is_alive():
            self._sender.join(timeout=5.0)

    def _send_loop(self) -> None:
        while (entry := self._outbox.get()) is not None:
            relay, item = entry
            try:
                relay(item)
            except Exception as exc:  # a failed send ends that request, never the sender
                relay.cancel()
                if not relay.done.done():
                    relay.done.set_exception(exc)

    def submit(self, inputs: GenerationInputs, emit: Callable[[Chunk], None],
               is_cancelled: Callable[[], bool]) -> Future:
        """Queues one request; emit gets its chunks on the engine thread. The future resolves when it ends."""
        done: Future = Future()
        request = self._request(inputs)
        relay = _Relay(inputs.streaming, emit, is_cancelled, done,
                       cancel=lambda: self.core.abort(request.request_id), on_end=self._count_reused)
        try:
            self.core.add_request(request, lambda item: self._outbox.put((relay, item)))
        except Exception as exc:  # invalid or over capacity: report it to the client at once
            relay(exc)
        return done

    def kv_metrics(self) -> dict[str, float]:
        return self.kv.update(self.core.snapshot() if self.core is not None else {})

    def _count_reused(self, cached_tokens: int) -> None:
        self.kv.reused_blocks_total += cached_tokens // self.kv.tokens_per_block

    def _request(self, inputs: GenerationInputs):
        from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams

        return Request(
            request_id=RequestId(f"triton-{uuid.uuid4().hex[:12]}"), prompt_token_ids=inputs.token_ids,
            sampling=SamplingParams(max_tokens=inputs.max_tokens, temperature=inputs.temperature,
                                    top_p=inputs.top_p, top_k=inputs.top_k, seed=inputs.seed,
                                    # end_id < 0: no end token (ignore_eos), as with tensorrt_llm
                                    stop_token_ids=() if inputs.end_id is None or inputs.end_id < 0
                                    else (inputs.end_id,),
                                    ignore_eos=inputs.end_id is not None and inputs.end_id < 0),
            arrival_s=time.monotonic(), pinned_member=MemberName(self.member), complexity_hint=0.0)


@dataclass(slots=True)
class _Relay:
    """One request's sink: core outputs -> Chunks (each delta when streaming, everything at the end otherwise)."""

    streaming: bool
    emit: Callable[[Chunk], None]
    is_cancelled: Callable[[], bool]
    done: Future
    cancel: Callable[[], None]
    on_end: Callable[[int], None]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cached_tokens: int = 0

    def __call__(self, item) -> None:
        if self.done.done():
            return
        if isinstance(item, BaseException) or item.error:
            message = item.error if not isinstance(item, BaseException) else f"{type(item).__name__}: {item}"
            self._end(Chunk([], [], self.cached_tokens, final=True, error=message))
            return
        self.cached_tokens = max(self.cached_tokens, item.num_cached_prompt_tokens)
        if self.is_cancelled():   # the client went away: free the pages, send nothing more
            self.cancel()
            self._end(None)
            return
        self.token_ids += item.new_token_ids
        self.logprobs += item.new_logprobs
        if self.streaming and (item.new_token_ids or item.finished):
            self.emit(Chunk(list(item.new_token_ids), list(item.new_logprobs), self.cached_tokens, final=item.finished))
        if item.finished:
            self._end(None if self.streaming else Chunk(self.token_ids, self.logprobs, self.cached_tokens, final=True))

    def _end(self, last: Chunk | None) -> None:
        self.on_end(self.cached_tokens)
        if last is not None:
            self.emit(last)
        self.done.set_result(None)


# ----------------------------------------------------------------------------- Triton binding
class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.member = params["mfs_member"]
        self.worker = MemberWorker(params["mfs_family_dir"], self.member, int(params["mfs_num_pages"]),
                                   int(params["mfs_page_bytes"]), params["mfs_dtype"])
        self.worker.start()
        family = pb_utils.MetricFamily(name=KV_METRIC_NAME, description=KV_METRIC_HELP,
                                       kind=pb_utils.MetricFamily.GAUGE)
        self._gauges = {kind: family.Metric(labels={"model": args["model_name"], "version": args["model_version"],
                                                    "kv_cache_block_type": kind})
                        for kind in KV_BLOCK_TYPES}
        self._metric_family = family   # the family must outlive its metrics
        self._publish_metrics()

    def execute(self, requests: list) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = parse_inputs(lambda name, r=request: _as_numpy(r, name))
            except ValueError as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            future = self.worker.submit(inputs, lambda chunk, s=sender, i=inputs: self._send(s, i, chunk),
                                        sender.is_cancelled)
            future.add_done_callback(lambda _f: self._publish_metrics())
        return None  # decoupled: responses go through each request's sender

    def finalize(self) -> None:
        self.worker.stop()

    def _send(self, sender, inputs: GenerationInputs, chunk: Chunk) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if chunk.error is not None:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(chunk.error)), flags=final)
            return
        if chunk.token_ids:
            sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(inputs, chunk)))
        if chunk.final:
            sender.send(flags=final)   # the empty final response (client: enable_empty_final_response)

    def _tensors(self, inputs: GenerationInputs, chunk: Chunk) -> list:
        n = len(chunk.token_ids)
        logprobs = chunk.logprobs if inputs.return_log_probs else [0.0] * n
        tensors = [
            pb_utils.Tensor("output_ids", np.asarray(chunk.token_ids, dtype=np.int32).reshape(1, 1, n)),
            pb_utils.Tensor("sequence_length", np.asarray([[n]], dtype=np.int32)),
            pb_utils.Tensor("output_log_probs", np.asarray(logprobs, dtype=np.float32).reshape(1, 1, n)),
            pb_utils.Tensor("cum_log_probs", np.asarray([[math.fsum(logprobs)]], dtype=np.float32)),
        ]
        if inputs.return_perf_metrics:
            tpb = self.worker.kv.tokens_per_block
            reused = chunk.num_cached_prompt_tokens // tpb
            total = -(-len(inputs.token_ids) // tpb)
            for name, value in (("kv_cache_reused_blocks", reused), ("kv_cache_alloc_total_blocks", total),
                                ("kv_cache_alloc_new_blocks", total - reused)):
                tensors.append(pb_utils.Tensor(name, np.asarray([[value]], dtype=np.int32)))
        return tensors

    def _publish_metrics(self) -> None:
        try:
            for kind, value in self.worker.kv_metrics().items():
                self._gauges[kind].set(float(value))
        except Exception as exc:  # metrics must never fail a request
            pb_utils.Logger.log_warn(f"mfs {self.member}: KV metrics update failed: {exc}")


def _as_numpy(request, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
