"""Triton model repository writers: one KV budget split across members, one config.pbtxt per member model.

Configs are built as tritonclient's ModelConfig protobuf and printed with text_format, so every file
Triton reads is valid by construction (tests parse them back). Both backends expose the SAME tensor
interface (the tensorrt_llm model's), so the client in engines/triton does not care which one runs.
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from orchestrator.core.family import FamilySpec, MemberSpec, read_checkpoint_config

PYTHON_MODEL_SOURCE = Path(__file__).resolve().parent.parent / "engines" / "triton" / "python_model" / "model.py"
MANIFEST_NAME = "mfs_repo.json"      # read by humans and tests; Triton ignores plain files at the root
KV_METRIC_NAME = "nv_trt_llm_kv_cache_block_metrics"


@dataclass(frozen=True, slots=True)
class MemberKV:
    """One member's slice of the global KV budget."""

    member: str
    share: float                    # fraction of the budget
    bytes_per_token: int            # K+V of every layer, at the serving dtype (whole model, all TP ranks)
    tokens_per_block: int
    budget_bytes: int               # share * budget
    max_tokens: int                 # max_tokens_in_paged_kv_cache: whole blocks that fit budget_bytes
    num_pages: int                  # python backend only: local-engine pages (one layer x one block each)

    @property
    def used_bytes(self) -> int:
        return self.max_tokens * self.bytes_per_token


def parameter_count(member: MemberSpec) -> int:
    """Approximate weights of a Llama/Qwen2 member from its config.json (embeddings + layers + head)."""
    config = read_checkpoint_config(member.checkpoint_dir)
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim, kv_dim = member.num_heads * member.head_dim, member.num_kv_heads * member.head_dim
    per_layer = hidden * (q_dim + 2 * kv_dim) + q_dim * hidden + 3 * hidden * inter + 2 * hidden
    embed = member.vocab_size * hidden
    head = 0 if config.get("tie_word_embeddings", False) else embed
    return embed + head + member.num_layers * per_layer + hidden


def kv_shares(family: FamilySpec) -> dict[str, float]:
    """Budget fractions: family.yaml 'kv_share' on every member if given, else proportional to parameters.

    Why parameters: a member's cost per cached token (layers x kv width) and its share of long, hard
    requests both grow with size, so a split by weights keeps each member's token capacity within a small
    factor of the others' instead of starving the large one.
    """
    explicit = {m.name: m.serving.get("kv_share") for m in family.members}
    if all(isinstance(v, (int, float)) and v > 0 for v in explicit.values()):
        total = float(sum(explicit.values()))
        return {name: float(v) / total for name, v in explicit.items()}
    if any(v is not None for v in explicit.values()):
        raise ValueError("family.yaml: set a positive 'kv_share' on every member or on none "
                         f"(got {explicit})")
    params = {m.name: parameter_count(m) for m in family.members}
    total = float(sum(params.values()))
    return {name: p / total for name, p in params.items()}


def split_kv_budget(family: FamilySpec, budget_bytes: int, dtype_bytes: int,
                    tokens_per_block: dict[str, int], page_bytes: int | None = None) -> list[MemberKV]:
    """One global KV budget -> per-member max_tokens_in_paged_kv_cache (whole blocks, never above budget)."""
    shares = kv_shares(family)
    split = []
    for member in family.members:
        tpb = tokens_per_block[member.name]
        per_token = member.num_layers * member.kv_bytes_per_token_per_layer(dtype_bytes)
        member_bytes = int(budget_bytes * shares[member.name])
        num_blocks = member_bytes // (per_token * tpb)
        if num_blocks < 1:
            raise ValueError(f"member {member.name}: KV budget share {member_bytes} bytes holds no block of "
                             f"{tpb} tokens ({per_token} bytes per token): raise --kv-budget-gb")
        pages = (member_bytes // page_bytes) if page_bytes else 0
        split.append(MemberKV(member=member.name, share=shares[member.name], bytes_per_token=per_token,
                              tokens_per_block=tpb, budget_bytes=member_bytes, max_tokens=num_blocks * tpb,
                              num_pages=pages))
    return split


# ----------------------------------------------------------------------------- the shared tensor interface
def _tensor(name: str, dtype: str, dims: list[int], optional: bool = False, scalar: bool = False,
            ragged: bool = False) -> mc.ModelInput:
    tensor = mc.ModelInput(name=name, data_type=mc.DataType.Value(dtype), dims=dims, optional=optional,
                           allow_ragged_batch=ragged)
    if scalar:
        tensor.reshape.shape[:] = []     # [1] per request, a scalar to the backend (as tensorrt_llm declares)
        tensor.reshape.SetInParent()
    return tensor


def interface_inputs() -> list[mc.ModelInput]:
    """The subset of tensorrt_llm's inputs MFS sends (token ids in: MFS tokenizes at its own edge)."""
    return [
        _tensor("input_ids", "TYPE_INT32", [-1], ragged=True),
        _tensor("input_lengths", "TYPE_INT32", [1], scalar=True),
        _tensor("request_output_len", "TYPE_INT32", [1]),
        _tensor("end_id", "TYPE_INT32", [1], optional=True, scalar=True),
        _tensor("pad_id", "TYPE_INT32", [1], optional=True, scalar=True),
        _tensor("streaming", "TYPE_BOOL", [1], optional=True),
        _tensor("runtime_top_k", "TYPE_INT32", [1], optional=True, scalar=True),
        _tensor("runtime_top_p", "TYPE_FP32", [1], optional=True, scalar=True),
        _tensor("temperature", "TYPE_FP32", [1], optional=True, scalar=True),
        _tensor("random_seed", "TYPE_UINT64", [1], optional=True, scalar=True),
        _tensor("return_log_probs", "TYPE_BOOL", [1], optional=True, scalar=True),
        _tensor("return_perf_metrics", "TYPE_BOOL", [1], optional=True, scalar=True),
        _tensor("stop", "TYPE_BOOL", [1], optional=True),
    ]


def interface_outputs() -> list[mc.ModelOutput]:
    def out(name: str, dtype: str, dims: list[int]) -> mc.ModelOutput:
        return mc.ModelOutput(name=name, data_type=mc.DataType.Value(dtype), dims=dims)
    return [
        out("output_ids", "TYPE_INT32", [-1, -1]),
        out("sequence_length", "TYPE_INT32", [-1]),
        out("cum_log_probs", "TYPE_FP32", [-1]),
        out("output_log_probs", "TYPE_FP32", [-1, -1]),
        # Per-request reuse, filled when return_perf_metrics is true (tensorrt_llm names).
        out("kv_cache_reused_blocks", "TYPE_INT32", [1]),
        out("kv_cache_alloc_new_blocks", "TYPE_INT32", [1]),
        out("kv_cache_alloc_total_blocks", "TYPE_INT32", [1]),
    ]


def _base_config(name: str, backend: str, max_batch_size: int) -> mc.ModelConfig:
    config = mc.ModelConfig(name=name, backend=backend, max_batch_size=max_batch_size)
    config.model_transaction_policy.decoupled = True      # streaming: one response per new token
    config.input.extend(interface_inputs())
    config.output.extend(interface_outputs())
    return config


def _set_params(config: mc.ModelConfig, params: dict[str, object]) -> None:
    for key, value in params.items():
        if isinstance(value, bool):
            value = "true" if value else "false"
        config.parameters[key].string_value = str(value)


def tensorrt_llm_config(member: str, engine_dir: Path, kv: MemberKV, max_batch_size: int,
                        scheduler_policy: str, gpu_device_ids: str | None, family: str) -> mc.ModelConfig:
    """The tensorrt_llm model of one member (tensorrtllm_backend 'inflight_batcher_llm' parameters)."""
    config = _base_config(member, "tensorrtllm", max_batch_size)
    config.dynamic_batching.max_queue_delay_microseconds = 0
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)  # the executor owns the GPU(s)
    params: dict[str, object] = {
        "gpt_model_type": "inflight_fused_batching",
        "gpt_model_path": str(engine_dir),
        "max_beam_width": 1,
        "batch_scheduler_policy": scheduler_policy,
        "enable_kv_cache_reuse": True,
        # An absolute token cap instead of kv_cache_free_gpu_mem_fraction: a fraction applies to the memory
        # free AFTER the models loaded before it, so with several members on one GPU it would depend on
        # load order. The fraction stays as a safety ceiling (the smaller of the two wins).
        "max_tokens_in_paged_kv_cache": kv.max_tokens,
        "kv_cache_free_gpu_mem_fraction": 0.95,
        "exclude_input_in_output": True,
        "enable_chunked_context": True,
        "normalize_log_probs": False,
        "mfs_family": family,
        "mfs_member": member,
        "mfs_tokens_per_block": kv.tokens_per_block,
    }
    if gpu_device_ids:
        params["gpu_device_ids"] = gpu_device_ids
    _set_params(config, params)
    return config


def python_member_config(member: str, family_dir: Path, kv: MemberKV, page_bytes: int, dtype: str,
                         max_batch_size: int, family: str) -> mc.ModelConfig:
    """A python-backend model that runs the LOCAL engine for one member behind the tensorrt_llm interface."""
    config = _base_config(member, "python", max_batch_size)
    config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    _set_params(config, {
        "mfs_family": family,
        "mfs_family_dir": str(family_dir),
        "mfs_member": member,
        "mfs_num_pages": kv.num_pages,
        "mfs_page_bytes": page_bytes,
        "mfs_dtype": dtype,
        "mfs_tokens_per_block": kv.tokens_per_block,
        "max_tokens_in_paged_kv_cache": kv.max_tokens,
        "enable_kv_cache_reuse": True,
    })
    return config


def write_config(model_dir: Path, config: mc.ModelConfig) -> Path:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "1").mkdir(exist_ok=True)
    path = model_dir / "config.pbtxt"
    path.write_text(text_format.MessageToString(config))
    return path


def read_config(path: Path) -> mc.ModelConfig:
    """Parses a config.pbtxt as Triton's ModelConfig (raises text_format.ParseError if it is not one)."""
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


def install_python_model(model_dir: Path) -> Path:
    """Copies the python-backend model source into <model>/1/model.py (a copy: the repo is self-contained)."""
    target = model_dir / "1" / "model.py"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PYTHON_MODEL_SOURCE, target)
    return target


def write_manifest(repo: Path, family: FamilySpec, backend: str, budget_bytes: int,
                   split: list[MemberKV], extra: dict | None = None) -> Path:
    data = {
        "family": family.name, "family_dir": str(family.root), "backend": backend,
        "kv_budget_bytes": budget_bytes,
        "members": {kv.member: {"share": round(kv.share, 6), "tokens_per_block": kv.tokens_per_block,
                                "max_tokens_in_paged_kv_cache": kv.max_tokens,
                                "bytes_per_token": kv.bytes_per_token, "num_pages": kv.num_pages}
                    for kv in split},
        **(extra or {}),
    }
    path = repo / MANIFEST_NAME
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
