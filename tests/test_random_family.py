"""Random-weight families of real shapes (build_scripts/random_family.py): what timing runs on a GPU load instead of
downloaded weights. The engine draws each tensor from (seed, name), so nested members share their lower layers
exactly as their lineages say; and the CUDA validation script runs its whole pipeline (checked on the CPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from build_scripts.random_family import PRESETS, main as random_family_main, write_family
from engines.local.checkpoint import load_checkpoint
from engines.local.model import PagedCausalLM
from orchestrator.core.family import FamilyError, load_family
from orchestrator.core.types import SamplingParams, SeqChunk

ROOT = Path(__file__).resolve().parents[1]


def test_nested_preset_shares_lower_layers_by_lineage_and_by_value(tmp_path):
    family = load_family(write_family("tiny", tmp_path / "fam"))
    small, middle, large = family.members
    assert [m.num_layers for m in family.members] == [2, 3, 4]
    assert family.shared_depth(small.name, large.name) == 2 and family.shared_depth(middle.name, large.name) == 3
    a, b = load_checkpoint(small.checkpoint_dir), load_checkpoint(large.checkpoint_dir)
    for layer in range(2):
        assert torch.equal(a.layers[layer].qkv, b.layers[layer].qkv)
        assert torch.equal(a.layers[layer].down, b.layers[layer].down)
    assert torch.equal(a.embed, b.embed) and torch.equal(a.norm, b.norm)
    assert torch.equal(a.layers[0].input_norm, torch.ones(64))            # a fresh model's norms
    assert not torch.equal(b.layers[2].qkv, b.layers[3].qkv)               # each tensor its own draw
    assert 0.015 < float(b.layers[3].gate_up.std()) < 0.025                # std 0.02


def test_seed_changes_weights_and_lineages(tmp_path):
    one = load_family(write_family("tiny", tmp_path / "a", seed=0))
    two = load_family(write_family("tiny", tmp_path / "b", seed=1))
    assert one.members[0].layer_lineages[0] != two.members[0].layer_lineages[0]
    w1, w2 = (load_checkpoint(f.members[0].checkpoint_dir) for f in (one, two))
    assert not torch.equal(w1.layers[0].qkv, w2.layers[0].qkv)


def test_forward_is_deterministic_across_loads(tmp_path):
    family = load_family(write_family("tiny", tmp_path / "fam"))
    member = family.members[-1]
    from engines.local.arena import KVArena

    logits = []
    for _ in range(2):
        model = PagedCausalLM(member, load_checkpoint(member.checkpoint_dir))
        arena = KVArena(num_pages=16, page_bytes=16384, device="cpu")
        block = model.block_tokens(arena)
        tables = [[layer * 2, layer * 2 + 1] for layer in range(member.num_layers)]
        chunk = SeqChunk(request_id="r", token_ids=list(range(5, 5 + 2 * block - 3)), start_pos=0,
                         block_tables=tables, sample=True, sampling=SamplingParams())
        logits.append(model.forward(arena, [chunk]))
    assert logits[0].shape == (1, member.vocab_size)
    assert torch.equal(logits[0], logits[1])


def test_independent_preset_has_real_shapes_and_weight_bytes(tmp_path):
    out = write_family("llama3-1b-3b-8b", tmp_path / "fam")
    manifest_members = load_family(out).members          # lineages from the declaration: no weights drawn here
    config = json.loads((out / "rand-8b" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_key_value_heads"], config["head_dim"]) == (32, 4096, 14336, 8, 128)
    assert [m.num_layers for m in manifest_members] == [16, 28, 32]
    assert load_family(out).shared_depth("rand-1b", "rand-3b") == 0     # each member its own seed
    text = (out / "family.yaml").read_text()
    assert "weight_bytes" in text and "random weights" in text.lower()
    from eval.weights import member_weight_bytes
    sizes = member_weight_bytes(load_family(out))
    per_layer = 2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096 + 2 * 4096      # q, o; k, v; MLP; norms
    assert sizes["rand-8b"] == 2 * (32 * per_layer + 4096 * 4096 + 4096)   # bf16; tied 4,096-id embedding


def test_bad_declaration_and_non_empty_out_are_refused(tmp_path, capsys):
    out = write_family("tiny", tmp_path / "fam")
    assert random_family_main(["--preset", "tiny", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    config_path = out / "rand-s" / "config.json"
    config = json.loads(config_path.read_text())
    config["mfs_random_weights"] = {"seed": "zero", "std": 0.02}
    config_path.write_text(json.dumps(config))
    with pytest.raises(FamilyError, match="mfs_random_weights"):
        load_family(out)
    assert set(PRESETS) >= {"tiny", "llama3.2-1b-nested", "llama3-1b-3b-8b"}


def _script(env_extra: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, **env_extra}
    return subprocess.run(["bash", str(ROOT / "eval/validate/cuda_validation.sh")], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_validation_script_refuses_without_cuda(tmp_path):
    result = _script({}, tmp_path)
    assert result.returncode == 3
    assert "no CUDA device here" in result.stdout
    assert (tmp_path / "out" / "validation_cuda.log").is_file()


def test_cuda_validation_script_pipeline_on_cpu(tmp_path):
    """The device script end to end at one rate with the smallest preset on the CPU: family built, saved trace
    replayed (no ShareGPT package needed), real runs, fits, simulations, the JSON written."""
    result = _script({"ALLOW_CPU": "1", "CHECKS": "validation", "PRESET": "tiny", "DTYPE": "float32",
                      "PAGE_BYTES": "16384", "KV_PAGES": "512", "RATES": "4"}, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "validation_cuda.json").read_text())
    assert summary["rates"] == [4.0] and summary["systems"] == ["mfs", "baseline"]
    errors = summary["by_rate"]["4.0"]["held_out"]["errors"]
    assert set(errors) == {"mfs", "baseline"}
    assert all(e["mean_token_latency_s"] is not None for e in errors.values())
    assert "--family" in summary["command"] and "escalation.enabled=false" in summary["command"]


def test_cuda_validation_script_speculation_check_on_cpu(tmp_path):
    """The script's speculation check, shortened, on the CPU: acceptance of every tiny pair at both
    temperatures and the draft / verify costs asked for, printed and written as JSON."""
    result = _script({"ALLOW_CPU": "1", "CHECKS": "speculation", "SPEC_PROMPTS": "1", "SPEC_TOKENS": "8",
                      "SPEC_COST_K": "1,2", "SPEC_COST_BATCH": "1,4"}, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = json.loads((tmp_path / "out" / "speculation_cuda.json").read_text())
    assert "cpu" in table["source"] and not (tmp_path / "out" / "validation_cuda.json").exists()
    pairs = {("tiny-s", "tiny-m"), ("tiny-s", "tiny-l"), ("tiny-m", "tiny-l")}
    assert {(r["draft"], r["target"], r["temperature"]) for r in table["acceptance"]} == {
        (d, t, temperature) for d, t in pairs for temperature in (0.0, 1.0)}
    assert all(0.0 <= r["per_token_acceptance"] <= 1.0 for r in table["acceptance"] if r["verify_steps"])
    assert {(r["draft"], r["target"], r["k"], r["batch"]) for r in table["costs"]} == {
        (d, t, k, b) for d, t in pairs for k in (1, 2) for b in (1, 4)}
    assert all(r["step_ms"] > 0 and r["draft_ms"] > 0 for r in table["costs"])
    assert all(r["ride_step_ms"] > 0 and r["apart_step_ms"] > 0 for r in table["costs"])
    assert "verify ms" in result.stdout and "ride ms" in result.stdout and "tok/step" in result.stdout
