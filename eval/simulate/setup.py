"""What a simulation runs on: the family, its cost model, the memory each device gives the KV arena, and each
system's config (the bench's own system definitions, eval.systems, plus the settings a GPU deployment needs).

Paper-scale families take their member configs and step costs from an aiconfigurator step table; the table is
built once per (family, GPU, backend, tensor-parallel sizes) and kept in eval/simulate/tables/ (so a run needs
aiconfigurator only when no table exists yet). A family run on this machine (the shipped tiny families) takes its
step costs from its own measured cost model (eval/simulate/paths.py names the files; eval.simulate.measure makes one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.baseline.split_pool import split_pages
from eval.simulate.acceptance import AcceptanceTable
from eval.simulate.cost_model import BatchShape, CostModel, TableCostModel
from eval.simulate.families import (DEFAULT_BLOCK_TOKENS, DRAFTS_ONLY, FREE_GPU_MEMORY_FRACTION,
                                    HOST_TIER_GIB_PER_GPU, PRESETS, DeviceMemory, page_bytes_for, paper_family,
                                    tensor_parallel)
from eval.simulate.fleet import Placement, PlacementError, member_homes
from eval.simulate.paths import fitted_model_path, measure_command, measured_table_path
from eval.simulate.step_table import StepTable, StepTableError, load_table, save_table
from eval.weights import member_weight_bytes, weight_bytes
from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec, load_family

TABLES_DIR = Path(__file__).resolve().parent / "tables"
# A GPU deployment's scheduler: TensorRT-LLM's defaults are max_batch_size 2048 and max_num_tokens 8192; MFS's
# defaults are sized for the 2-core CPU engine. These apply to paper-scale families (docs/CONFIG.md, simulate).
# router.load_saturation_tokens: the default (4096) is a few tiny-family requests; on a GPU a member holds
# hundreds of multi-thousand-token sequences before it saturates (256 running x 512 tokens).
# router.downgrade_running: 2 running requests is a busy member on the CPU, an idle one on a GPU.
# router.downgrade_max_escalation_rate: at paper scale the wait-avoiding downgrades (token saturation) sent many
# requests into members that escalated them back out (measured on the paper-scale curves).
# decode_step_token_budget None: a step's tokens are capped by max_batch_tokens alone, as the baseline's are. The
# CPU default (512) let a GPU step carry hundreds of decodes and almost no prefill: past the knee MFS queued for
# prefill (SIMULATED 1.7B/8B/32B at 8 sessions/s: 162.0 ms/token with 512, 115.4 with 2048, 109.6 without;
# as measured on the paper-scale curves).
GPU_SCHEDULER = {"scheduler.max_running_requests": 256, "scheduler.max_batch_tokens": 8192,
                 "scheduler.prefill_chunk_tokens": 2048, "scheduler.max_queue": 4096, "engine.dtype": "bfloat16",
                 "scheduler.decode_step_token_budget": None,
                 "router.load_saturation_tokens": 131072, "router.downgrade_running": None,
                 "router.downgrade_max_escalation_rate": 0.5,
                 # in-family speculation as a GPU deployment of MFS runs it (the systems that run without it, the
                 # separate deployments and mfs_no_spec, turn it off: eval/systems.py SPECULATION_SWITCH). SIMULATED
                 # Qwen3 1.7B/8B/32B on one H200, seed 0: 9.8 against 15.3 ms per token at 0.5 sessions/s
                 "speculation.enabled": True}
SOLO_DECODE_CONTEXT = 64        # the bench's decode probe: a 4-token prompt, up to 48 generated tokens


@dataclass(slots=True)
class SimSetup:
    family_name: str
    family: FamilySpec | None             # None: EngineCore loads it per system (the shipped tiny, as the bench)
    member_names: list[str]
    cost: CostModel
    placement: Placement
    num_pages: int                        # per node
    page_bytes: int
    split: dict[str, float] | None        # per-member placement: the physical split both systems get
    overrides: dict[str, Any] = field(default_factory=dict)
    # per node: the KV host tier of every system that keeps one (None: the config's own, as the tiny family)
    host_tier_mb: float | None = None
    memory: dict[str, Any] = field(default_factory=dict)
    gpu: str | None = None
    notes: list[str] = field(default_factory=list)
    capacity_policy: str = "max_utilization"      # every system's admission (cli.CAPACITY_POLICIES)
    colocated_deployments: str = "turns"          # separate deployments on one device: shared | turns (node.py)
    acceptance: AcceptanceTable | None = None   # speculation: what a simulated verify accepts (acceptance.py)
    free_fraction: float = FREE_GPU_MEMORY_FRACTION
    # pooled placement: each node's home members, for the front router (fleet.member_homes); None: no homes
    member_homes: list[tuple[str, ...]] | None = None

    @property
    def members_in_parallel(self) -> bool:
        return self.placement.kind == "per-member"

    def solo_decode_step_s(self) -> dict[str, float]:
        """What the bench's decode probe would measure: one request decoding alone at short context."""
        return {m: self.cost.step_overhead_s() + self.cost.batch_s(BatchShape(m, (SOLO_DECODE_CONTEXT,), ()))
                for m in self.member_names}


def private_draft_memory(setup: SimSetup, config: MFSConfig) -> str | None:
    """Takes the draft copies of a system whose servers each keep their own (comparison.private_drafts, speculating)
    out of its KV memory: each larger member's server holds the smallest member's weights too, which take their
    share of the GPU memory the arena is made of ((memory - weights) x free_fraction). Servers sharing GPUs
    (colocated: the operator chooses each one's share) keep their split of what is left; a server on GPUs of its own
    (per-member placement: the split is the GPUs') loses its copy from its own slice. Paper-scale families only (the
    tiny family's pool is given in pages). Returns what it did."""
    if setup.family is None or not (config.speculation.enabled and config.comparison.private_drafts):
        return None
    draft = setup.family.members[0]
    pages = int(int(draft.serving["weight_bytes"]) * setup.free_fraction) // setup.page_bytes
    targets = [m.name for m in setup.family.members[1:]]
    split = config.comparison.static_split
    if split is None or setup.split is None:
        config.pool.num_pages -= pages * len(targets)
    else:
        per = split_pages(config.pool.num_pages, split)
        for name in targets:
            per[name] -= pages
        if min(per.values()) <= 0:
            raise PlacementError(f"a draft copy of {draft.name} ({pages} pages) leaves a server no KV memory: {per}")
        config.pool.num_pages = sum(per.values())
        config.comparison.static_split = {m: n / config.pool.num_pages for m, n in per.items()}
    return (f"{draft.name}'s weights held once more by each of {', '.join(targets)}'s servers (their own draft "
            f"copies): {pages} pages each out of their KV memory")


def drafter_memory(setup: SimSetup, config: MFSConfig) -> str | None:
    """Gives separate deployments sharing the family's GPUs (colocated placement) back the memory of a drafts_only
    member's weights: they hold no server of it (a speculating one takes its own copy, private_draft_memory). Paper-
    scale families only. Returns what it did."""
    drafter = setup.family.drafter if setup.family is not None else None
    if drafter is None or setup.placement.kind != "colocated":
        return None
    pages = int(int(drafter.serving["weight_bytes"]) * setup.free_fraction) // setup.page_bytes
    config.pool.num_pages += pages
    return f"no server of {drafter.name} (drafts_only): its weights' {pages} pages are KV memory here"


def load_cost_model(path: str | Path, name: str) -> CostModel:
    """An mfs-step-table/1 grid or an mfs-step-fit/1 linear model, by the file's format."""
    import json

    from eval.simulate.cost_model import FIT_FORMAT, LinearCostModel

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise StepTableError(f"cost model {path}: cannot read it as JSON ({exc})") from None
    if isinstance(data, dict) and data.get("format") == FIT_FORMAT:
        model = LinearCostModel.from_dict(data)
        model.name = name
        return model
    return TableCostModel(StepTable.from_dict(data, f"step table {path}"), name)


def is_paper_family(name: str) -> bool:
    return name in PRESETS


def measured_model_path(table_path: str | None, family_name: str = "tiny") -> Path:
    """The measured cost model to use: the given file; by default the family's model fitted to real bench runs (it
    carries the serving loop's cost under the bench's load), else its offline grid (either may be missing)."""
    if table_path:
        return Path(table_path)
    fitted = fitted_model_path(family_name)
    return fitted if fitted.is_file() else measured_table_path(family_name)


def missing_model(family: str, family_name: str, table_path: str | None) -> str:
    """One line saying the measured cost model is missing and how to make it."""
    if table_path:
        return f"no step table at {table_path}"
    return (f"no measured cost model for {family_name} at {measured_table_path(family_name)}: measure it on this "
            f"machine, with nothing else running, with `{measure_command(family, family_name)}`")


def tiny_setup(family: str, table_path: str | None, placement: Placement, kv_pages: int) -> SimSetup:
    """A shipped family (or a family directory) on its measured step table of this machine."""
    if placement.kind != "colocated":
        raise PlacementError("the measured cost model describes this machine's one local engine: use --placement "
                             "colocated or fleet:N (nodes of this machine)")
    spec = load_family(family)
    path = measured_model_path(table_path, spec.name)
    if not path.is_file():
        raise StepTableError(missing_model(family, spec.name, table_path))
    cost = load_cost_model(path, "measured")
    from orchestrator.core.config import load_config

    page_bytes = load_config(overrides={"family": family}).pool.page_bytes
    return SimSetup(family_name=spec.name, family=None, member_names=spec.member_names,
                    cost=cost, placement=placement, num_pages=kv_pages,
                    page_bytes=page_bytes, split=None)


def paper_setup(family: str, gpu: str, backend: str, placement: Placement, table_path: str | None,
                block_tokens: int = DEFAULT_BLOCK_TOKENS, free_fraction: float = FREE_GPU_MEMORY_FRACTION,
                host_tier_gib_per_gpu: float = HOST_TIER_GIB_PER_GPU, saves_overlap: bool = True,
                member_tp: dict[str, int] | None = None, mixed_steps: str = "overlap") -> SimSetup:
    """member_tp: per-member placement, a member's tensor parallelism above the least that holds it.
    host_tier_gib_per_gpu: host memory for the KV host tier per GPU of a node (0: no host tier).
    saves_overlap: copies of evicted pages to the host tier run beside the step's compute, on the GPU's copy
    stream (TensorRT-LLM's KV cache transfer manager offloads on a stream of its own; vLLM's offloading
    connector likewise), so a step costs max(compute, saves) + loads; False charges them before the step.
    mixed_steps: how a step holding decodes and a prefill chunk is priced (cost_model.TableCostModel)."""
    from eval.simulate.aic_table import build_aic_table

    preset = PRESETS[family]
    notes: list[str] = []
    if table_path:
        if member_tp:
            raise PlacementError("--member-tp chooses the step table's tensor parallelism; --step-table names one")
        table = load_table(table_path)
    else:
        # Configs (and GPU memory) first, from any table of this family and GPU, else a tp=1 build: TP depends on them.
        probe = _cached_table(family, gpu, backend, None) or StepTable.from_dict(
            build_aic_table([(n, m, 1) for n, m in preset], gpu, backend))
        configs = {n: probe.member(n).hf_config for n, _ in preset}
        tps = _drafter_tp(family, _with_member_tp(_tensor_parallel(configs, probe.gpu_memory_bytes, placement),
                                                  member_tp, placement))
        table = _cached_table(family, gpu, backend, tps)
        if table is None:
            table = StepTable.from_dict(build_aic_table([(n, m, tps[n]) for n, m in preset], gpu, backend))
            save_table(table, _table_path(family, gpu, backend, tps))
            notes.append(f"aiconfigurator step table built and saved to {_table_path(family, gpu, backend, tps)}")
    configs = [(n, table.member(n).hf_config) for n, _ in preset]
    spec = paper_family(family, configs)
    page_bytes = page_bytes_for([c for _, c in configs], block_tokens)
    gpu_mem = int(table.gpu_memory_bytes)
    weights = member_weight_bytes(spec)     # paper_family's, from the HF configs
    split = None
    if placement.kind == "colocated":
        gpus = table.member(preset[0][0]).tp
        device = DeviceMemory(gpus, gpu_mem * gpus, sum(weights.values()), free_fraction, page_bytes)
        if device.num_pages <= 0:
            raise PlacementError(f"{family} does not fit on {gpus} x {gpu} ({device.to_dict()})")
        memory = {"device": device.to_dict()}
        num_pages = device.num_pages
    else:
        # one deployment per member requests go to: a drafts_only member has no server of its own (each
        # speculating deployment holds its own copy, private_draft_memory)
        devices = {n: DeviceMemory(table.member(n).tp, gpu_mem * table.member(n).tp, weights[n], free_fraction,
                                   page_bytes) for n in spec.serving_names}
        memory = {n: d.to_dict() for n, d in devices.items()}
        num_pages = sum(d.num_pages for d in devices.values())
        split = {n: d.num_pages / num_pages for n, d in devices.items()}
    overrides = {**GPU_SCHEDULER, "pool.page_bytes": page_bytes}
    gpus_per_node = (table.member(preset[0][0]).tp if placement.kind == "colocated"
                     else sum(table.member(n).tp for n in spec.serving_names))
    host_tier_gib = host_tier_gib_per_gpu * gpus_per_node
    return SimSetup(family_name=family, family=spec, member_names=spec.member_names, free_fraction=free_fraction,
                    cost=TableCostModel(table, "aiconfigurator", saves_overlap, mixed_steps), placement=placement,
                    num_pages=num_pages,
                    page_bytes=page_bytes, split=split, overrides=overrides, host_tier_mb=host_tier_gib * 1024, gpu=gpu,
                    memory={**memory, "block_tokens": block_tokens, "weights_gib": {n: round(w / 2**30, 2)
                                                                                   for n, w in weights.items()},
                            "host_tier_gib": host_tier_gib, "host_tier_gib_per_gpu": host_tier_gib_per_gpu},
                    notes=notes)


def pooled_setups(family: str, gpu: str, backend: str, num_gpus: int, table_path: str | None,
                  block_tokens: int = DEFAULT_BLOCK_TOKENS, free_fraction: float = FREE_GPU_MEMORY_FRACTION,
                  host_tier_gib_per_gpu: float = HOST_TIER_GIB_PER_GPU,
                  saves_overlap: bool = True, member_tp: dict[str, int] | None = None,
                  mixed_steps: str = "overlap") -> tuple[SimSetup, SimSetup]:
    """pooled:N (fleet.py): the family's systems on N/G colocated nodes of G GPUs each (G: the tensor parallelism
    the whole family needs), the separate deployments on N/M per-member nodes (M: the GPUs one copy of every
    member needs, each at its own tensor parallelism). N must be a multiple of both, so neither has a GPU left."""
    if table_path:
        raise PlacementError("--placement pooled:N builds one step table per placement; --step-table names one")
    from eval.simulate.aic_table import build_aic_table

    preset = PRESETS[family]
    probe = _cached_table(family, gpu, backend, None) or StepTable.from_dict(
        build_aic_table([(n, m, 1) for n, m in preset], gpu, backend))
    configs = {n: probe.member(n).hf_config for n, _ in preset}
    group = next(iter(_tensor_parallel(configs, probe.gpu_memory_bytes, Placement("colocated")).values()))
    per_member_tps = _with_member_tp(_tensor_parallel(configs, probe.gpu_memory_bytes, Placement("per-member")),
                                     member_tp, Placement("per-member"))
    drafter = DRAFTS_ONLY.get(family)       # no deployment of its own: it takes no GPUs among the per-member ones
    per_member_tps = {n: tp for n, tp in per_member_tps.items() if n != drafter}
    per_member = sum(per_member_tps.values())
    if num_gpus % group or num_gpus % per_member:
        need = group * per_member // math.gcd(group, per_member)
        raise PlacementError(f"--placement pooled:{num_gpus}: {family} on {gpu} needs a multiple of {group} GPUs "
                             f"(one node holding the whole family) and of {per_member} (one GPU group per member, "
                             f"for the separate deployments): try pooled:{need}")
    common = dict(block_tokens=block_tokens, free_fraction=free_fraction, host_tier_gib_per_gpu=host_tier_gib_per_gpu,
                  saves_overlap=saves_overlap, mixed_steps=mixed_steps)
    pooled = paper_setup(family, gpu, backend, Placement("colocated", num_gpus // group), None, **common)
    pooled.member_homes = member_homes(num_gpus // group, per_member_tps)
    separate = paper_setup(family, gpu, backend, Placement("per-member", num_gpus // per_member), None, **common,
                           member_tp=member_tp)
    pooled.notes.append(f"pooled:{num_gpus}: the family's systems on {num_gpus // group} node(s) of {group} GPU(s) "
                        f"each holding every member; the separate deployments on {num_gpus // per_member} set(s) "
                        f"of per-member GPUs ({per_member} GPUs each)")
    return pooled, separate


def _tensor_parallel(configs: dict[str, dict], gpu_memory_bytes: int, placement: Placement) -> dict[str, int]:
    if placement.kind == "colocated":     # every member sharded over the same GPUs
        tp = tensor_parallel(sum(weight_bytes(c) for c in configs.values()), gpu_memory_bytes)
        return {n: tp for n in configs}
    return {n: tensor_parallel(weight_bytes(c), gpu_memory_bytes) for n, c in configs.items()}


def _drafter_tp(family: str, tps: dict[str, int]) -> dict[str, int]:
    """A drafts_only member runs on its targets' GPUs (it has none of its own): at the widest deployment's tensor
    parallelism, its cheapest draft forward on this table's prices (the separate deployments' draft copies run on
    their targets' GPUs; one TP per member in a table, so a narrower deployment's copy is priced as cheap)."""
    drafter = DRAFTS_ONLY.get(family)
    if drafter is None or drafter not in tps:
        return tps
    return {**tps, drafter: max(tp for name, tp in tps.items() if name != drafter)}


def _with_member_tp(tps: dict[str, int], member_tp: dict[str, int] | None, placement: Placement) -> dict[str, int]:
    """The least tensor parallelism that holds each member, raised where member_tp asks (per-member placement: a
    deployment may shard a member wider than it must, for lower latency per token)."""
    if not member_tp:
        return tps
    if placement.kind == "colocated":
        raise PlacementError("--member-tp sets a member's own GPUs: use --placement per-member or pooled:N")
    unknown = set(member_tp) - set(tps)
    if unknown:
        raise PlacementError(f"--member-tp: {', '.join(sorted(unknown))} is not a member (members: {', '.join(tps)})")
    for name, tp in member_tp.items():
        if tp < tps[name] or tp & (tp - 1):
            raise PlacementError(f"--member-tp {name}={tp}: expected a power of two of at least {tps[name]} (the "
                                 "least that holds its weights)")
    return {name: member_tp.get(name, tp) for name, tp in tps.items()}


def _table_path(family: str, gpu: str, backend: str, tps: dict[str, int]) -> Path:
    return TABLES_DIR / f"{family}_{gpu}_{backend}_tp{'-'.join(str(t) for t in tps.values())}.json"


def _cached_table(family: str, gpu: str, backend: str, tps: dict[str, int] | None) -> StepTable | None:
    if tps is not None:
        path = _table_path(family, gpu, backend, tps)
        return load_table(path) if path.is_file() else None
    found = sorted(TABLES_DIR.glob(f"{family}_{gpu}_{backend}_tp*.json"))
    return load_table(found[0]) if found else None
