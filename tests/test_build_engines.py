"""build-engines without a server: dry-run TensorRT-LLM repositories, commands, KV budget split, python repositories."""
from __future__ import annotations

import shlex

import pytest

from build_scripts import triton_repo
from build_scripts.build_engines import GIB, main as build_engines
from build_scripts.trtllm_commands import BuildSettings
from orchestrator.core.family import load_family
from tests.triton_helpers import family_dir

FAMILY = family_dir()
MEMBERS = ("tiny-s", "tiny-m", "tiny-l")


def _params(config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def _dry_run(tmp_path, capsys, *extra: str, family: str = str(FAMILY)) -> tuple[str, int]:
    code = build_engines(["--family", family, "--out", str(tmp_path), "--dry-run", "--kv-budget-gb", "2",
                          "--trtllm-examples", "/opt/TensorRT-LLM/examples", *extra])
    return capsys.readouterr().out, code


@pytest.mark.parametrize("family_name", ["tiny", "tiny-sep"])
def test_dry_run_writes_parsable_tensorrt_llm_configs(family_name, tmp_path, capsys):
    _, code = _dry_run(tmp_path, capsys, family=family_name)
    assert code == 0
    repo = tmp_path / "triton_repo"
    for member in load_family(family_name).member_names:
        config = triton_repo.read_config(repo / member / "config.pbtxt")   # raises if not a ModelConfig
        params = _params(config)
        assert config.name == member and config.backend == "tensorrtllm"
        assert config.model_transaction_policy.decoupled is True
        assert params["enable_kv_cache_reuse"] == "true"
        assert params["batch_scheduler_policy"] == "guaranteed_no_evict"
        assert params["gpt_model_type"] == "inflight_fused_batching"
        assert params["gpt_model_path"] == str(tmp_path / "engines" / member)
        assert params["mfs_tokens_per_block"] == "32"
        assert int(params["max_tokens_in_paged_kv_cache"]) % 32 == 0
        inputs = {t.name: t for t in config.input}
        assert {"input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "streaming",
                "runtime_top_k", "runtime_top_p", "temperature", "random_seed", "return_log_probs"} <= set(inputs)
        assert [o.name for o in config.output][:4] == ["output_ids", "sequence_length", "cum_log_probs",
                                                      "output_log_probs"]
        assert (repo / member / "1").is_dir()


def test_dry_run_prints_both_steps_per_member_with_every_flag(tmp_path, capsys):
    out, code = _dry_run(tmp_path, capsys, "--tp", "2")
    assert code == 0
    lines = [shlex.split(line) for line in out.splitlines() if "convert_checkpoint.py" in line or
             line.startswith("trtllm-build")]
    assert len(lines) == 2 * len(MEMBERS)
    family = load_family(FAMILY)
    for member, convert, build in zip(family.members, lines[0::2], lines[1::2]):
        assert convert[1] == "/opt/TensorRT-LLM/examples/llama/convert_checkpoint.py"
        flags = dict(zip(convert[2::2], convert[3::2]))
        assert flags == {"--model_dir": str(member.checkpoint_dir),
                         "--output_dir": str(tmp_path / "trtllm_checkpoints" / member.name),
                         "--dtype": "float16", "--tp_size": "2"}
        assert build[0] == "trtllm-build"
        flags = dict(zip(build[1::2], build[2::2]))
        assert flags == {"--checkpoint_dir": str(tmp_path / "trtllm_checkpoints" / member.name),
                         "--output_dir": str(tmp_path / "engines" / member.name),
                         "--gemm_plugin": "auto", "--gpt_attention_plugin": "auto", "--kv_cache_type": "paged",
                         "--use_paged_context_fmha": "enable", "--remove_input_padding": "enable",
                         "--tokens_per_block": "32", "--max_batch_size": "64", "--max_num_tokens": "8192",
                         "--max_seq_len": str(min(8192, member.context_tokens))}
    assert (tmp_path / "build_commands.sh").read_text().count("trtllm-build") == len(MEMBERS)


def test_budget_split_fills_the_one_budget_and_favours_larger_members(tmp_path, capsys):
    _, code = _dry_run(tmp_path, capsys)
    assert code == 0
    family = load_family(FAMILY)
    budget = 2 * GIB
    used, shares = 0, []
    for member in family.members:
        config = triton_repo.read_config(tmp_path / "triton_repo" / member.name / "config.pbtxt")
        tokens = int(_params(config)["max_tokens_in_paged_kv_cache"])
        per_token = member.num_layers * member.kv_bytes_per_token_per_layer(2)   # float16
        used += tokens * per_token
        shares.append(tokens * per_token)
    slack = sum(32 * m.num_layers * m.kv_bytes_per_token_per_layer(2) for m in family.members)
    assert budget - slack < used <= budget          # whole blocks only, never over the budget
    assert shares == sorted(shares)                 # split by parameter count: larger members get more bytes


def test_kv_share_from_family_yaml_overrides_parameter_split():
    family = load_family(FAMILY)
    members = tuple(type(m)(**{**{f: getattr(m, f) for f in m.__slots__}, "serving": {"kv_share": s}})
                    for m, s in zip(family.members, (1, 1, 2)))
    custom = type(family)(name=family.name, members=members, root=family.root)
    split = triton_repo.split_kv_budget(custom, GIB, 2, {m.name: 32 for m in members})
    assert [round(kv.share, 3) for kv in split] == [0.25, 0.25, 0.5]
    assert sum(kv.used_bytes for kv in split) <= GIB


def test_without_dry_run_and_without_tensorrt_llm_it_says_what_is_missing(tmp_path, capsys):
    code = build_engines(["--family", str(FAMILY), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0
    assert "tensorrt_llm" in err and "trtllm-build" in err and "--dry-run" in err
    assert not (tmp_path / "triton_repo").exists()


def test_tokens_per_block_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        BuildSettings(tokens_per_block=48).validate("tiny-s")


@pytest.mark.parametrize("family_name", ["tiny", "tiny-sep"])
def test_python_backend_repo_parses_and_carries_the_local_engine_settings(family_name, tmp_path, capsys):
    """The nested family and the separate-weight one (independent members, no shared layer) alike."""
    code = build_engines(["--family", family_name, "--out", str(tmp_path), "--backend", "python",
                          "--kv-budget-gb", "0.03"])
    assert code == 0
    repo = tmp_path / "triton_repo"
    family = load_family(family_name)
    total_pages_bytes = 0
    for member in family.members:
        config = triton_repo.read_config(repo / member.name / "config.pbtxt")
        params = _params(config)
        assert config.backend == "python" and config.model_transaction_policy.decoupled is True
        assert params["mfs_member"] == member.name and params["mfs_family_dir"] == str(family.root)
        assert params["mfs_tokens_per_block"] == "16"       # 16 KiB pages, float32, 2 kv heads x 64
        assert int(params["mfs_num_pages"]) > 0
        total_pages_bytes += int(params["mfs_num_pages"]) * int(params["mfs_page_bytes"])
        assert (repo / member.name / "1" / "model.py").read_text() == triton_repo.PYTHON_MODEL_SOURCE.read_text()
        # Same tensor interface as the tensorrt_llm model.
        assert [t.name for t in config.input] == [t.name for t in triton_repo.interface_inputs()]
    assert total_pages_bytes <= 0.03 * GIB
    assert (repo / triton_repo.MANIFEST_NAME).is_file()
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == sorted(family.member_names)
