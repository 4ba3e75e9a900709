"""asyncio client for family members served by Triton: one gRPC decoupled stream per request, plus KV metrics.

Speaks the tensorrt_llm model's tensor interface, so it serves TensorRT-LLM engines and the python-backend
models alike. Transport failures become EngineUnavailableError (HTTP 503); model errors become MFSError.
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc

from orchestrator.core.errors import EngineUnavailableError, InvalidRequestError, MFSError
from orchestrator.core.types import SamplingParams

KV_METRIC_NAME = "nv_trt_llm_kv_cache_block_metrics"
_CLOSE_TIMEOUT_S = 5.0     # a completed stream's RPC end (our half-close -> Triton's status); then cancel it
_METRIC_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
# Codes that mean "Triton is not there (any more)", not "this request was bad".
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN,
                      grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


@dataclass(frozen=True, slots=True)
class StreamDelta:
    """One streamed response: new tokens (may be empty on the final one) and per-request KV reuse."""

    token_ids: list[int]
    logprobs: list[float]
    reused_blocks: int | None      # kv_cache_reused_blocks, when the model returned it
    final: bool


def parse_kv_block_metrics(text: str) -> dict[str, dict[str, float]]:
    """Prometheus text -> {model: {kv_cache_block_type: value}} for nv_trt_llm_kv_cache_block_metrics."""
    found: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith(KV_METRIC_NAME + "{"):
            continue
        match = _METRIC_LINE.match(line)
        if match is None:
            continue
        labels = dict(_LABEL.findall(match["labels"]))
        kind, model = labels.get("kv_cache_block_type"), labels.get("model")
        if kind and model:
            found.setdefault(model, {})[kind] = float(match["value"])
    return found


def _input(name: str, array: np.ndarray, datatype: str) -> tuple[service_pb2.ModelInferRequest.InferInputTensor, bytes]:
    tensor = service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=list(array.shape))
    return tensor, array.tobytes()


_INT32 = np.iinfo(np.int32)
_UINT64_MASK = 2**64 - 1


def _int32(field: str, *values: int) -> None:
    """Every value packed into an INT32 tensor fits it: numpy would wrap an out-of-range one silently
    (top_k 4294967301 becomes 5, 2147483648 becomes negative)."""
    for value in values:
        if not _INT32.min <= value <= _INT32.max:
            raise InvalidRequestError(f"'{field}' must be in [{_INT32.min}, {_INT32.max}] with the Triton engine "
                                      f"(a 32-bit integer there), got {value}", field)


def check_packable(sampling: SamplingParams, num_tokens: int = 0, max_tokens: int = 0) -> None:
    """A 400 naming the field for any value the tensorrt_llm inputs cannot carry as sent. The seed needs no
    check: the edge accepts [-2^63, 2^64), and a negative seed is sent as its 64-bit two's complement."""
    _int32("top_k", sampling.top_k)
    _int32("max_tokens", max_tokens, num_tokens)


def build_request(model: str, token_ids: list[int], sampling: SamplingParams, request_id: str,
                  end_id: int | None, max_tokens: int) -> service_pb2.ModelInferRequest:
    """The tensorrt_llm inputs ([1, n] ids, [1, 1] scalars), streaming on, log probs and perf metrics on.
    InvalidRequestError (400) naming the field for a value its tensor's type cannot hold."""
    check_packable(sampling, len(token_ids), max_tokens)
    ids = np.asarray([token_ids], dtype=np.int64)
    if ids.size and (ids.min() < _INT32.min or ids.max() > _INT32.max):
        _int32("prompt", int(ids.min()), int(ids.max()))
    request = service_pb2.ModelInferRequest(model_name=model, id=request_id)
    tensors = [
        _input("input_ids", ids.astype(np.int32), "INT32"),
        _input("input_lengths", np.asarray([[len(token_ids)]], dtype=np.int32), "INT32"),
        _input("request_output_len", np.asarray([[max_tokens]], dtype=np.int32), "INT32"),
        _input("streaming", np.asarray([[True]], dtype=np.bool_), "BOOL"),
        _input("return_log_probs", np.asarray([[True]], dtype=np.bool_), "BOOL"),
        _input("return_perf_metrics", np.asarray([[True]], dtype=np.bool_), "BOOL"),
        _input("temperature", np.asarray([[sampling.temperature]], dtype=np.float32), "FP32"),
        _input("runtime_top_p", np.asarray([[sampling.top_p]], dtype=np.float32), "FP32"),
        _input("runtime_top_k", np.asarray([[sampling.top_k]], dtype=np.int32), "INT32"),
    ]
    if end_id is not None:
        tensors.append(_input("end_id", np.asarray([[end_id]], dtype=np.int32), "INT32"))
        tensors.append(_input("pad_id", np.asarray([[max(end_id, 0)]], dtype=np.int32), "INT32"))
    if sampling.seed is not None:
        tensors.append(_input("random_seed", np.asarray([[sampling.seed & _UINT64_MASK]], dtype=np.uint64),
                              "UINT64"))
    for tensor, raw in tensors:
        request.inputs.append(tensor)
        request.raw_input_contents.append(raw)
    # Ask for the empty final response so the end of a decoupled stream is explicit.
    request.parameters["triton_enable_empty_final_response"].bool_param = True
    return request


class TritonClient:
    """One gRPC channel to Triton; reconnect() replaces it after an outage."""

    def __init__(self, url: str, metrics_url: str | None = None):
        self.url = url
        self.metrics_url = metrics_url
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None

    async def connect(self) -> None:
        await self.close()
        self._channel = grpc.aio.insecure_channel(self.url, options=[
            ("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)])
        self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(grace=None)
        self._channel = self._stub = None

    async def is_ready(self, timeout_s: float = 1.0) -> bool:
        if self._stub is None:
            return False
        try:
            reply = await self._stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=timeout_s)
            return bool(reply.ready)
        except grpc.aio.AioRpcError:
            return False

    async def model_parameters(self, model: str, timeout_s: float = 5.0) -> dict[str, str]:
        """The model's config.pbtxt parameters (string values), e.g. mfs_tokens_per_block."""
        try:
            reply = await self._stub.ModelConfig(service_pb2.ModelConfigRequest(name=model), timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, model) from exc
        return {key: value.string_value for key, value in reply.config.parameters.items()}

    async def kv_block_metrics(self, timeout_s: float = 2.0) -> dict[str, dict[str, float]]:
        if not self.metrics_url:
            return {}
        import httpx

        async with httpx.AsyncClient(timeout=timeout_s) as http:
            reply = await http.get(self.metrics_url)
            reply.raise_for_status()
        return parse_kv_block_metrics(reply.text)

    async def generate(self, model: str, token_ids: list[int], sampling: SamplingParams, request_id: str,
                       end_id: int | None, max_tokens: int) -> AsyncIterator[StreamDelta]:
        """Streams one request; closing the iterator early cancels it in Triton."""
        if self._stub is None:
            raise EngineUnavailableError("Triton is not connected")
        request = build_request(model, token_ids, sampling, request_id, end_id, max_tokens)
        done = asyncio.Event()

        async def requests():
            yield request
            await done.wait()   # keep our half open until the final response: Triton streams until then

        call = self._stub.ModelStreamInfer(requests())
        completed = False
        try:
            async for reply in call:
                if reply.error_message:
                    raise _model_error(reply.error_message, model)
                result = InferResult(reply.infer_response)
                params = reply.infer_response.parameters
                final = "triton_final_response" in params and params["triton_final_response"].bool_param
                ids = result.as_numpy("output_ids")
                logprobs = result.as_numpy("output_log_probs")
                reused = result.as_numpy("kv_cache_reused_blocks")
                token_list = [] if ids is None else [int(t) for t in ids.reshape(-1)]
                lp_list = [float(x) for x in logprobs.reshape(-1)] if logprobs is not None else [0.0] * len(token_list)
                yield StreamDelta(token_list, lp_list[:len(token_list)],
                                  None if reused is None else int(reused.reshape(-1)[0]), final)
                if final:
                    completed = True
                    return
            raise EngineUnavailableError(f"Triton closed the stream of {model} before its final response")
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc, model) from exc
        finally:
            done.set()                     # half-closes our side: after a final response Triton ends the RPC
            if completed:
                # No cancel once the request is complete: a cancellation racing a finished request is a known
                # tritonserver gRPC crash (server issues #7368, #8034); under the 32-stream serving bench it
                # aborted tritonserver (grpc "ASSERTION FAILED: prior > 0") and, in another run, left 32
                # streams of one client waiting forever. Wait (bounded) for the RPC's own end instead.
                try:
                    await asyncio.wait_for(call.code(), _CLOSE_TIMEOUT_S)
                except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                    call.cancel()
            else:
                call.cancel()              # closed early (client gone, hand-over, error): cancel it in Triton


def _model_error(message: str, model: str) -> MFSError:
    lowered = message.lower()
    if "unavailable" in lowered or "not ready" in lowered or "stub process" in lowered:
        return EngineUnavailableError(f"Triton model {model}: {message}")
    return MFSError(f"Triton model {model}: {message}")


def _translate(exc: grpc.aio.AioRpcError, model: str) -> MFSError:
    if exc.code() in _UNAVAILABLE_CODES:
        return EngineUnavailableError(f"Triton unavailable ({exc.code().name}) serving {model}: {exc.details()}")
    return MFSError(f"Triton error ({exc.code().name}) serving {model}: {exc.details()}")
