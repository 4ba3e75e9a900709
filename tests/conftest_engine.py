"""Helpers for the local-engine tests: tiny random HF checkpoints and families on disk, a page counter, a step driver."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from orchestrator.core.types import MemberBatch, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

VOCAB = 256


def write_tokenizer(folder: Path) -> None:
    vocab = {f"t{i}": i for i in range(VOCAB)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))


def llama_config(num_layers: int = 2, **overrides):
    from transformers import LlamaConfig

    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.2, eos_token_id=2, bos_token_id=1, tie_word_embeddings=True,
                    rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    settings.update(overrides)
    return LlamaConfig(**settings)


def qwen2_config(num_layers: int = 2, **overrides):
    from transformers import Qwen2Config

    settings = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                    initializer_range=0.2, eos_token_id=2, tie_word_embeddings=False)
    settings.update(overrides)
    return Qwen2Config(**settings)


def build_model(config, seed: int = 0):
    """A random transformers model in fp32, with non-zero biases and norms so every weight matters."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.eval()


def save_checkpoint(model, folder: Path, max_shard_size: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    write_tokenizer(folder)
    return folder


def write_family(root: Path, members: list[tuple[str, object]], name: str = "testfam") -> Path:
    """members: (name, transformers model), small to large; writes family.yaml + one checkpoint each."""
    root.mkdir(parents=True, exist_ok=True)
    for member_name, model in members:
        save_checkpoint(model, root / member_name)
    manifest = {"name": name, "members": [{"name": n, "checkpoint": n} for n, _ in members]}
    (root / "family.yaml").write_text(yaml.safe_dump(manifest))
    return root


def nested_pair(config_factory, small_layers: int, large_layers: int, seed: int = 0):
    """(small, large): the small model IS the large one's lower layers (same embeddings, norm, head)."""
    large = build_model(config_factory(num_layers=large_layers), seed=seed)
    small = build_model(config_factory(num_layers=small_layers), seed=seed + 1)
    state = {k: v for k, v in large.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < small_layers}
    small.load_state_dict(state, strict=False)
    return small, large


def nested_family_on_disk(root: Path, config_factory, depths: dict[str, int], other_norm: bool = False,
                          prepare=None) -> Path:
    """A family small to large (depths: member -> layers) where every member is the largest one's lower layers
    (same embeddings, norm, head). other_norm gives the smallest member its own final norm, which the lineages
    do not see; prepare(large) may change the largest model before the smaller ones are cut from it."""
    names = list(depths)
    large = build_model(config_factory(num_layers=depths[names[-1]]), seed=0)
    if prepare is not None:
        prepare(large)
    members = []
    for name in names[:-1]:
        depth = depths[name]
        model = build_model(config_factory(num_layers=depth), seed=depth)
        state = {k: v for k, v in large.state_dict().items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < depth}
        model.load_state_dict(state, strict=False)
        if other_norm and name == names[0]:
            with torch.no_grad():
                model.model.norm.weight.mul_(1.5)
        members.append((name, model))
    return write_family(root, members + [(names[-1], large)])


class PageCounter:
    """The tests' stand-in for the ledger: hands out fresh page ids."""

    def __init__(self, num_pages: int) -> None:
        self.next_page, self.num_pages = 0, num_pages

    def take(self, count: int = 1) -> list[PageId]:
        if self.next_page + count > self.num_pages:
            raise RuntimeError("test arena exhausted")
        pages = [PageId(p) for p in range(self.next_page, self.next_page + count)]
        self.next_page += count
        return pages


@dataclass(slots=True)
class EngineRequest:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    tables: list[list[PageId]]                      # per layer
    cached_tokens: int = 0                          # prompt tokens already in the tables' pages
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generated: list[int] = field(default_factory=list)
    fed: int = 0                                    # tokens whose K/V are written

    def done(self) -> bool:
        return len(self.generated) >= self.max_new_tokens


def next_chunk(request: EngineRequest, pages: PageCounter, block: int, chunk_tokens: int | None) -> SeqChunk:
    """The request's next chunk: a prefill piece (at most chunk_tokens) or one decode token."""
    if request.fed == 0:
        request.fed = request.cached_tokens
    sequence = request.prompt + request.generated
    if request.fed < len(request.prompt):
        end = len(request.prompt) if chunk_tokens is None else min(len(request.prompt), request.fed + chunk_tokens)
    else:
        end = len(sequence)
    tokens, start = sequence[request.fed:end], request.fed
    needed_blocks = -(-end // block)
    for table in request.tables:
        table.extend(pages.take(needed_blocks - len(table)) if needed_blocks > len(table) else [])
    request.fed = end
    return SeqChunk(request_id=RequestId(request.request_id), token_ids=tokens, start_pos=start,
                    block_tables=request.tables, sample=end >= len(request.prompt), sampling=request.sampling,
                    num_generated=len(request.generated))


def run_to_completion(executor, member: str, requests: list[EngineRequest], pages: PageCounter,
                      chunk_tokens: int | None = None) -> None:
    """Steps every unfinished request together (continuous batching) until all have their tokens."""
    block = executor.tokens_per_block(member)
    while any(not r.done() for r in requests):
        active = [r for r in requests if not r.done()]
        chunks = [next_chunk(r, pages, block, chunk_tokens) for r in active]
        sampled = executor.execute(StepPlan(batches=[MemberBatch(member=member, chunks=chunks)]))
        by_id = {s.request_id: s for s in sampled}
        for request in active:
            if request.request_id in by_id:
                request.generated.append(by_id[request.request_id].token_id)


def hf_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
    return out[0, len(prompt):].tolist()


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def shipped_decode_logits(prompts: list[list[int]], new_tokens: int, **executor_options):
    """(executor, the logits of every sampled step) when the shipped tiny-l prefills `prompts` in one step and decodes
    `new_tokens` - 1 more, through a real LocalExecutor built with `executor_options` (one torch thread)."""
    from engines.local.executor import LocalExecutor
    from orchestrator.core.family import SHIPPED_FAMILIES_DIR, load_family

    family = load_family(SHIPPED_FAMILIES_DIR / "tiny")
    member = family.members[-1]
    page_bytes = 16 * member.kv_bytes_per_token_per_layer(4)
    num_pages = 4 * member.num_layers * 4
    executor = LocalExecutor(family, num_pages=num_pages, page_bytes=page_bytes, num_threads=1, **executor_options)
    logits: list[torch.Tensor] = []
    original = executor.sampler.sample

    def record(rows, chunks, eos):
        logits.append(rows.clone())
        return original(rows, chunks, eos)
    executor.sampler.sample = record
    requests = [EngineRequest(f"b{i}", prompt, new_tokens, [[] for _ in range(member.num_layers)],
                              sampling=SamplingParams(max_tokens=new_tokens)) for i, prompt in enumerate(prompts)]
    run_to_completion(executor, member.name, requests, PageCounter(num_pages))
    return executor, logits


def assert_decodes_alike(prompts: list[list[int]], option: str, attribute: str, new_tokens: int = 12) -> None:
    """The shipped tiny-l decodes `prompts` with the executor option `option` on and off: with it on, the
    executor's `attribute` (the native piece it enables) is loaded, and every step's logits agree within float32
    noise with the same greedy tokens."""
    with_it, native = shipped_decode_logits(prompts, new_tokens, **{option: True})
    without, plain = shipped_decode_logits(prompts, new_tokens, **{option: False})
    assert getattr(with_it, attribute) is not None and getattr(without, attribute) is None
    assert len(native) == len(plain) == new_tokens
    for native_logits, torch_logits in zip(native, plain):
        torch.testing.assert_close(native_logits, torch_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
