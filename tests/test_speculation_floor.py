"""What draft-target speculation can give at best on a step table (eval/simulate/speculation_floor.py): the floors'
arithmetic against the cost model's own prices, the token latency a target reduction needs, and the command's
errors and output file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.simulate.acceptance import tokens_per_verify
from eval.simulate.cost_model import BatchShape, TableCostModel
from eval.simulate.speculation_floor import family_of, floors, main, needed
from eval.simulate.step_table import load_table

TABLES = Path(__file__).resolve().parent.parent / "eval" / "simulate" / "tables"
LLAMA = TABLES / "llama3.1_h200_sxm_trtllm_tp2-2.json"


def test_the_floors_are_the_cost_models_prices_per_verified_token():
    table = load_table(LLAMA)
    cost = TableCostModel(table)
    rows = floors(table, family_of(LLAMA, table), batches=(1, 8), context=1024, max_k=6)
    assert [(r["drafter"], r["target"], r["batch"]) for r in rows] == [("llama3.1-8b", "llama3.1-70b", 1),
                                                                       ("llama3.1-8b", "llama3.1-70b", 8)]
    for row in rows:
        batch, a = row["batch"], row["acceptance"]
        plain = cost.batch_s(BatchShape("llama3.1-70b", (1024,) * batch, ())) * 1e3
        draft = cost.batch_s(BatchShape("llama3.1-8b", (1024,) * batch, ())) * 1e3
        assert row["draft_forward_ms"] == pytest.approx(draft)
        assert row["drafts_on_path_ms"][0] == row["drafts_hidden_ms"][0] == row["drafts_ahead_ms"][0] == plain
        for k in range(1, 7):
            verify = cost.batch_s(BatchShape("llama3.1-70b", (), (), verifies=((k + 1, 1024),) * batch)) * 1e3
            tokens = tokens_per_verify(a, k)
            assert row["drafts_on_path_ms"][k] == pytest.approx((k * draft + verify) / tokens)
            assert row["drafts_hidden_ms"][k] == pytest.approx(verify / tokens)
            # drafting ahead lies between the two: it hides the drafts only after a full acceptance
            assert row["drafts_hidden_ms"][k] < row["drafts_ahead_ms"][k] < row["drafts_on_path_ms"][k]
        for name in ("on_path", "ahead", "hidden"):
            values = row[f"drafts_{name}_ms"]
            assert values[row[f"best_k_{name}"]] == min(values)


def test_with_no_acceptance_drafting_only_costs():
    table = load_table(LLAMA)
    row = floors(table, "llama3.1", batches=(1,), max_k=3, acceptance_override=0.0)[0]
    assert row["acceptance"] == 0.0
    assert all(v > row["drafts_on_path_ms"][0] for v in row["drafts_on_path_ms"][1:])
    assert row["best_k_on_path"] == 0
    with pytest.raises(ValueError):
        floors(table, "llama3.1", acceptance_override=1.0)


def _row(member: str, e2e_s: float, tokens: int, error: str | None = None) -> dict:
    return {"members": [member], "e2e_s": e2e_s, "output_tokens": tokens, "error": error}


def test_needed_keeps_the_other_requests_and_solves_for_the_members():
    result = {"systems": {
        "mfs": {"per_request": [_row("s", 1.0, 100), _row("l", 3.0, 100), _row("l", 1.0, 50),
                                _row("l", 9.0, 1, error="cancelled")]},
        "baseline": {"per_request": [_row("s", 2.0, 100), _row("l", 4.0, 100), _row("l", 3.0, 50)]}}}
    out = needed(result, "l", 0.5)
    baseline_mean = (0.02 + 0.04 + 0.06) / 3
    assert out["baseline_mean_ms"] == pytest.approx(baseline_mean * 1e3)
    assert out["requests"] == 3 and out["reached_member"] == 2          # the failed request is left out
    assert out["member_requests_mean_ms"] == pytest.approx((0.03 + 0.02) / 2 * 1e3)
    # with the large member's requests at the figure it returns, the mean is exactly half the baseline's
    assert (0.01 + 2 * out["member_requests_needed_ms"] / 1e3) / 3 == pytest.approx(0.5 * baseline_mean)
    with pytest.raises(ValueError, match="per_request"):
        needed({"systems": {"mfs": {}, "baseline": {}}}, "l", 0.5)
    with pytest.raises(ValueError, match="no request"):
        needed(result, "m", 0.5)


def test_the_command_writes_its_figures_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "floor.json"
    assert main(["--table", str(LLAMA), "--batches", "1", "--max-k", "4", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["format"] == "mfs-speculation-floor/1" and data["simulated"] is True
    assert data["family"] == "llama3.1" and len(data["floors"]) == 1 and data["needed"] == []
    assert "SIMULATED" in capsys.readouterr().out
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"systems": {"mfs": {"per_request": [_row("llama3.1-70b", 1.0, 100)]},
                                              "baseline": {"per_request": [_row("llama3.1-70b", 2.0, 100)]}}}))
    assert main(["--table", str(LLAMA), "--batches", "1", "--result", str(result), "--target", "0.6",
                 "--out", str(out)]) == 0
    (check,) = json.loads(out.read_text())["needed"]
    assert check["result"] == "r.json" and check["member_requests_needed_ms"] == pytest.approx(8.0)
    assert "measured" not in check and "no step profile" in capsys.readouterr().out
    # with the run's step profile: what the member's steps gave, and the floor at the system's own batch
    data = json.loads(result.read_text())
    for name, batch in (("mfs", 4.2), ("baseline", 9.0)):
        data["systems"][name]["simulation"] = {"step_profile": {"llama3.1-70b": {
            "batch": batch, "mean_context": 700.0, "tokens_per_request_step": 2.0, "token_period_ms": 10.0,
            "token_period_without_prompts_ms": 9.0, "prompt_tokens": 50, "steps": 3}}}
    result.write_text(json.dumps(data))
    assert main(["--table", str(LLAMA), "--batches", "1", "--max-k", "4", "--result", str(result),
                 "--out", str(out)]) == 0
    (check,) = json.loads(out.read_text())["needed"]
    assert check["measured"]["floor"]["batch"] == 4 and check["measured"]["floor"]["context"] == 700
    assert "floor at mfs's batch 4 and context 700" in capsys.readouterr().out
    data["systems"]["baseline"]["simulation"]["step_profile"] = {"llama3.1-8b": {}}
    result.write_text(json.dumps(data))
    assert main(["--table", str(LLAMA), "--result", str(result)]) == 2      # the member's steps missing: refused
    assert main(["--table", str(tmp_path / "missing.json")]) == 2
    assert main(["--table", str(LLAMA), "--target", "1.5"]) == 2
    assert main(["--table", str(LLAMA), "--batches", "0"]) == 2
    renamed = tmp_path / "table.json"
    renamed.write_text(LLAMA.read_text())
    assert main(["--table", str(renamed)]) == 2                         # no family in the name, none given
    assert main(["--table", str(renamed), "--family", "llama3.1", "--batches", "1"]) == 0
    assert "cannot tell the family" in capsys.readouterr().err
