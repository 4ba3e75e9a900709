"""Family loading: the shipped nested tiny family, lineages, tokenizer compatibility and clear errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eval.composition import per_member_lineages
from orchestrator.core.family import FamilyError, load_family, resolve_family_dir

TINY = resolve_family_dir("tiny")


def test_shipped_tiny_family_is_nested_and_ordered():
    family = load_family("tiny")
    assert family.name == "tiny" and family.member_names == ["tiny-s", "tiny-m", "tiny-l"]
    assert family.is_nested()
    assert family.shared_depth("tiny-s", "tiny-l") == family.member("tiny-s").num_layers
    assert family.member("tiny-m").layer_lineages[: family.member("tiny-s").num_layers] == \
        family.member("tiny-s").layer_lineages
    assert len({m.tokenizer_hash for m in family.members}) == 1
    assert family.member("tiny-l").tokens_per_block(16384, 4) == 16


def test_per_member_lineage_makes_an_independent_family():
    family = per_member_lineages(load_family("tiny"))
    assert family.shared_depth("tiny-s", "tiny-m") == 0 and not family.is_nested()


def copy_family(tmp_path: Path) -> Path:
    target = tmp_path / "fam"
    shutil.copytree(TINY, target)
    return target


def test_a_different_tokenizer_gets_its_own_hash(tmp_path):
    root = copy_family(tmp_path)
    tok = root / "tiny-l" / "tokenizer.json"
    data = json.loads(tok.read_text())
    data["added_tokens"][0]["content"] = "<|other-pad|>"
    tok.write_text(json.dumps(data))
    family = load_family(root)
    hashes = {m.name: m.tokenizer_hash for m in family.members}
    assert hashes["tiny-s"] == hashes["tiny-m"] != hashes["tiny-l"]     # block hashes are seeded with it


@pytest.mark.parametrize("breakage, message", [
    (lambda r: (r / "family.yaml").unlink(), "family.yaml: missing"),
    (lambda r: (r / "tiny-m" / "config.json").write_text("{not json"), "tiny-m/config.json: not valid JSON"),
    (lambda r: (r / "tiny-m" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]})),
     "'architectures'"),
    (lambda r: (r / "tiny-l" / "model.safetensors").unlink(), "no \\*.safetensors"),
    (lambda r: (r / "family.yaml").write_text("name: tiny\nmembers:\n  - {name: tiny-l}\n  - {name: tiny-s}\n"),
     "ordered small to large"),
    (lambda r: shutil.rmtree(r / "tiny-s"), "checkpoint folder"),
])
def test_broken_family_fails_with_file_and_field(tmp_path, breakage, message):
    root = copy_family(tmp_path)
    breakage(root)
    with pytest.raises(FamilyError, match=message):
        load_family(root)


def test_unknown_family_name():
    with pytest.raises(FamilyError, match="shipped"):
        load_family("no-such-family")
