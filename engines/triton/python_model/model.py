"""Triton python-backend model: one family member on the local MFS engine, behind the tensorrt_llm tensor interface.

Copied into <repo>/<member>/1/model.py by build-engines --backend python. The Triton-facing class is a thin
binding over MemberWorker (no Triton imports), which runs LocalServing on its own asyncio loop thread with
every request pinned to this member and escalation off: one member per model, like tensorrt_llm.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
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
START_TIMEOUT_S = 600.0


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
    """LocalServing for one member on a private asyncio loop thread; Triton-independent."""

    def __init__(self, family_dir: str, member: str, num_pages: int, page_bytes: int, dtype: str,
                 serving_factory: Callable | str | None = None):
        from orchestrator.core.config import load_config
        from orchestrator.core.family import load_family

        self.member = member
        self.family = load_family(family_dir)
        spec = self.family.member(member)
        self.config = load_config(overrides={
            "family": str(family_dir), "pool.num_pages": num_pages, "pool.page_bytes": page_bytes,
            "engine.kind": "local", "engine.device": "cpu", "engine.dtype": dtype, "engine.num_threads": 1,
            "escalation.enabled": False, "escalation.warmup": False, "pool.host_tier_mb": 0.0,
        })
        from orchestrator.core.family import dtype_bytes
        self.kv = KVBlockStats(spec.tokens_per_block(page_bytes, dtype_bytes(dtype)), spec.num_layers)
        self._factory = serving_factory
        self._serving = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"mfs-{member}", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if self._factory is None:
            from orchestrator.serve.serving import LocalServing
            self._factory = LocalServing
        elif isinstance(self._factory, str):   # "module:Class" from the model parameters
            import importlib
            module, _, name = self._factory.partition(":")
            self._factory = getattr(importlib.import_module(module), name)
        self._serving = self._factory(self.config)
        asyncio.run_coroutine_threadsafe(self._serving.start(), self._loop).result(START_TIMEOUT_S)

    def stop(self) -> None:
        if self._serving is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._serving.stop(1.0), self._loop).result(10.0)
            except Exception:  # shutting down: the stub exits next anyway
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)

    def submit(self, inputs: GenerationInputs, emit: Callable[[Chunk], None],
               is_cancelled: Callable[[], bool]) -> Future:
        return asyncio.run_coroutine_threadsafe(self._run(inputs, emit, is_cancelled), self._loop)

    def kv_metrics(self) -> dict[str, float]:
        return self.kv.update(self._serving.stats() if self._serving is not None else {})

    async def _run(self, inputs: GenerationInputs, emit: Callable[[Chunk], None],
                   is_cancelled: Callable[[], bool]) -> None:
        from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams

        request = Request(
            request_id=RequestId(f"triton-{uuid.uuid4().hex[:12]}"), prompt_token_ids=inputs.token_ids,
            sampling=SamplingParams(max_tokens=inputs.max_tokens, temperature=inputs.temperature,
                                    top_p=inputs.top_p, top_k=inputs.top_k, seed=inputs.seed,
                                    # end_id < 0: no end token (ignore_eos), as with tensorrt_llm
                                    stop_token_ids=() if inputs.end_id is None or inputs.end_id < 0
                                    else (inputs.end_id,),
                                    ignore_eos=inputs.end_id is not None and inputs.end_id < 0),
            arrival_s=time.monotonic(), pinned_member=MemberName(self.member))
        all_ids: list[int] = []
        all_logprobs: list[float] = []
        cached = 0
        try:
            async for out in self._serving.generate(request):
                if out.error:
                    emit(Chunk([], [], cached, final=True, error=out.error))
                    return
                cached = max(cached, out.num_cached_prompt_tokens)
                if is_cancelled():
                    self._serving.abort(request.request_id)
                    return
                if inputs.streaming and (out.new_token_ids or out.finished):
                    emit(Chunk(list(out.new_token_ids), list(out.new_logprobs), cached, final=out.finished))
                all_ids += out.new_token_ids
                all_logprobs += out.new_logprobs
                if out.finished:
                    break
        except Exception as exc:  # report to the client instead of leaving its stream open
            emit(Chunk([], [], cached, final=True, error=f"{type(exc).__name__}: {exc}"))
            return
        finally:
            self.kv.reused_blocks_total += cached // self.kv.tokens_per_block
        if not inputs.streaming:
            emit(Chunk(all_ids, all_logprobs, cached, final=True))


# ----------------------------------------------------------------------------- Triton binding
class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.member = params["mfs_member"]
        self.worker = MemberWorker(params["mfs_family_dir"], self.member, int(params["mfs_num_pages"]),
                                   int(params["mfs_page_bytes"]), params["mfs_dtype"],
                                   params.get("mfs_serving_factory") or None)
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
