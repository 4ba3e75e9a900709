"""The separate-weight tiny family's trainer: reply-ending data rule, files, separate lineages, resume."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from build_scripts import short_replies
from build_scripts import train_separate_family as trainer
from build_scripts.train_tiny_family import render_chat
from orchestrator.core.family import load_family
from orchestrator.sharegpt import Conversation

NESTED_TOKENIZER = Path(__file__).resolve().parents[1] / "engines" / "families" / "tiny" / "tiny-l"
TINY_RUN = ["--steps", "3", "--extra-steps", "0,0,2", "--conversations", "40", "--window", "64", "--batch-size", "2", "--eos-prompts", "0",
            "--eval-windows", "4", "--save-every", "1", "--tokenizer-from", str(NESTED_TOKENIZER)]


class Killed(Exception):
    """Stands for the process being killed mid-run."""


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_file(str(NESTED_TOKENIZER / "tokenizer.json"))


def _long_chat() -> Conversation:
    reply = " ".join(f"Sentence number {i} explains one more detail of the answer." for i in range(60))
    return Conversation("c1", ({"role": "user", "content": "Explain it."}, {"role": "assistant", "content": reply},
                               {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": "Welcome!"}))


def test_rule_cuts_long_replies_at_a_sentence_and_closes_them_with_eot(tokenizer):
    chat = _long_chat()
    cut = short_replies.cut_messages(tokenizer, chat, seed=0)
    first = cut[1]["content"]
    budget = short_replies.reply_budget(0, "c1", 1)
    assert first.endswith(".") and chat.messages[1]["content"].startswith(first)
    assert len(tokenizer.encode("\n" + first).ids) <= budget < len(tokenizer.encode(chat.messages[1]["content"]).ids)
    assert cut[3]["content"] == "Welcome!"  # short replies stay whole
    pieces = short_replies.conversation_pieces(tokenizer, chat, seed=0)
    ids = [i for piece, _ in pieces for i in piece]
    assert ids == tokenizer.encode(render_chat(cut)).ids  # same tokens the chat template renders
    eot_pieces = [w for piece, w in pieces if piece == [short_replies.EOT_ID]]
    assert eot_pieces == [short_replies.CONTEXT_WEIGHT, short_replies.EOT_WEIGHT] * 2  # user eot, reply eot


def test_budgets_are_deterministic_and_mostly_short():
    budgets = [short_replies.reply_budget(0, f"c{i}", 1) for i in range(2000)]
    assert budgets == [short_replies.reply_budget(0, f"c{i}", 1) for i in range(2000)]
    assert max(budgets) <= short_replies.BUDGET_MAX and sum(b < 100 for b in budgets) / len(budgets) > 0.9


def test_cut_without_a_sentence_end_stops_at_a_word(tokenizer):
    text = "\n" + "word " * 300
    cut = short_replies.cut_reply(text, tokenizer.encode(text).offsets, 20)
    assert cut.startswith("\nword") and cut.endswith("word") and len(tokenizer.encode(cut).ids) <= 20


def test_parameters_are_about_1_4_16():
    counts = [trainer.parameter_count(s) for s in trainer.MEMBERS.values()]
    assert 3.5 < counts[1] / counts[0] < 4.5 and 14 < counts[2] / counts[0] < 18
    assert {(s.num_kv_heads, s.head_dim) for s in trainer.MEMBERS.values()} == {(2, 64)}


def test_writes_a_separate_family_and_resumes(tmp_path, monkeypatch, capsys):
    out, ckpt = tmp_path / "fam", tmp_path / "ckpt"
    real_step = torch.optim.AdamW.step
    calls = {"n": 0}

    def dying_step(self, *a, **k):  # a kill during sep-s's third step: its checkpoint holds step 2
        calls["n"] += 1
        if calls["n"] == 3:
            raise Killed
        return real_step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", dying_step)
    with pytest.raises(Killed):
        trainer.main(TINY_RUN + ["--out", str(out), "--checkpoint-dir", str(ckpt)])
    assert torch.load(ckpt / "sep-s.pt", weights_only=False)["step"] == 2
    monkeypatch.setattr(torch.optim.AdamW, "step", real_step)
    trainer.main(TINY_RUN + ["--out", str(out), "--checkpoint-dir", str(ckpt)])
    assert "sep-s: resuming at step 2/3" in capsys.readouterr().out
    trainer.main(TINY_RUN + ["--out", str(tmp_path / "fresh"), "--checkpoint-dir", str(tmp_path / "ckpt2")])
    resumed, fresh = load_file(str(out / "sep-s" / "model.safetensors")), load_file(str(tmp_path / "fresh" / "sep-s" / "model.safetensors"))
    assert all(torch.equal(resumed[k], fresh[k]) for k in fresh)  # resuming continues the same run exactly

    record = json.loads((out / "training.json").read_text())
    assert [record["members"][m]["steps"] for m in trainer.MEMBERS] == [3, 3, 5]  # sep-l: a second cycle of 2
    for name in trainer.MEMBERS:
        files = {p.name for p in (out / name).iterdir()}
        assert {"config.json", "model.safetensors", "generation_config.json", *trainer.TOKENIZER_FILES} <= files
        assert (out / name / "tokenizer.json").read_bytes() == (NESTED_TOKENIZER / "tokenizer.json").read_bytes()
        assert all(t.dtype == torch.float16 for t in load_file(str(out / name / "model.safetensors")).values())
    assert (out / "README.md").is_file() and "kind: separate" in (out / "family.yaml").read_text()
    family = load_family(out)
    assert family.name == "tiny-sep" and family.member_names == list(trainer.MEMBERS)
    assert not family.is_nested() and len({m.tokenizer_hash for m in family.members}) == 1
    names = family.member_names
    assert all(family.shared_depth(a, b) == 0 for i, a in enumerate(names) for b in names[i + 1:])
    assert len({lineage for m in family.members for lineage in m.layer_lineages}) == sum(m.num_layers for m in family.members)
    assert len({m.tokenizer_hash for m in family.members} | {load_family("tiny").members[0].tokenizer_hash}) == 1

    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(str(out / "sep-s"), dtype=torch.float32)
    assert model.config.num_hidden_layers == 2


def test_the_second_cycle_restarts_the_cosine_lower():
    args = trainer.parse_args(["--steps", "100", "--extra-steps", "50", "--lr", "3e-3", "--extra-lr", "1e-3"])
    lrs = [trainer.learning_rate(step, 100, 50, args) for step in range(150)]
    assert max(lrs[:100]) == pytest.approx(3e-3, rel=0.01) and lrs[99] < 1e-5      # first cycle: warm-up, decay to ~0
    assert lrs[100] == pytest.approx(1e-3) and lrs[149] < lrs[120] < lrs[100]  # second: restarts at --extra-lr
