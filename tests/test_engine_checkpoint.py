"""Checkpoint loading: config normalisation, tied / sharded weights, rope scaling, and errors that name file and field."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest_engine import build_model, llama_config, qwen2_config, save_checkpoint
from engines.local.checkpoint import load_checkpoint, model_config, rope_inv_freq
from orchestrator.core.family import FamilyError


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_checkpoint(build_model(llama_config(num_layers=2)), tmp_path_factory.mktemp("llama") / "ckpt")


@pytest.fixture
def broken(llama_dir, tmp_path):
    """A fresh copy of the good checkpoint to damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(llama_dir, target)
    return target


def test_llama_tied_gqa_llama3_rope(llama_dir):
    weights = load_checkpoint(llama_dir)
    config = weights.config
    assert (config.arch, config.num_kv_heads, config.head_dim, config.rope_theta) == ("llama", 2, 16, 500000.0)
    assert config.rope_scaling["rope_type"] == "llama3"
    assert weights.lm_head is weights.embed                      # tied: no lm_head.weight in the file
    assert weights.layers[0].qkv.shape == ((4 + 2 * 2) * 16, 64)
    assert weights.layers[0].qkv_bias is None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers import LlamaConfig
    hf_config = LlamaConfig.from_pretrained(llama_dir)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    torch.testing.assert_close(weights.inv_freq, expected.float())


def test_qwen2_bias_untied_sharded(tmp_path):
    folder = save_checkpoint(build_model(qwen2_config(num_layers=2)), tmp_path / "q", max_shard_size="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    weights = load_checkpoint(folder, dtype="bfloat16")
    assert weights.config.arch == "qwen2" and weights.config.rope_scaling is None
    assert weights.layers[1].qkv_bias.shape == ((4 + 2 * 2) * 16,)
    assert weights.layers[1].o_bias is None
    assert weights.lm_head is not weights.embed and weights.embed.dtype == torch.bfloat16


def test_legacy_rope_fields(broken):
    config = json.loads((broken / "config.json").read_text())
    config.pop("rope_parameters")
    config["rope_theta"] = 1234.0
    config["rope_scaling"] = {"type": "linear", "factor": 2.0}
    (broken / "config.json").write_text(json.dumps(config))
    parsed = model_config(broken)
    assert parsed.rope_theta == 1234.0 and parsed.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    base = 1.0 / (1234.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    torch.testing.assert_close(rope_inv_freq(parsed), (base / 2).float())


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(FamilyError, match=r"config\.json: missing"):
        load_checkpoint(broken)


def test_bad_json(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(FamilyError, match=r"config\.json: not valid JSON"):
        load_checkpoint(broken)


def test_missing_weights(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(FamilyError, match=r"model\.safetensors: missing"):
        load_checkpoint(broken)


def _rewrite_tensors(folder, change):
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(broken):
    _rewrite_tensors(broken, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(FamilyError, match=r"model\.safetensors: tensor 'model\.layers\.1\.mlp\.down_proj\.weight' is missing"):
        load_checkpoint(broken)


def test_wrong_shape(broken):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = tensors["model.layers.0.self_attn.k_proj.weight"][:8]
    _rewrite_tensors(broken, shrink)
    with pytest.raises(FamilyError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(8, 64\), expected \(32, 64\)"):
        load_checkpoint(broken)


def test_unsupported_architecture(broken):
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(FamilyError, match=r"config\.json: field 'architectures'"):
        load_checkpoint(broken)


def test_unsupported_rope_scaling(broken):
    config = json.loads((broken / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(FamilyError, match=r"config\.json: field 'rope_parameters' rope_type = 'yarn'"):
        load_checkpoint(broken)


def test_missing_shard(tmp_path):
    folder = save_checkpoint(build_model(qwen2_config(num_layers=2)), tmp_path / "q", max_shard_size="60KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(FamilyError, match=r"index\.json: shard .* is missing"):
        load_checkpoint(folder)
