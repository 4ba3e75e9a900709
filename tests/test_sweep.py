"""eval.bench.sweep: the seeds section and its spread (run_bench replaced by a recorder: the bench itself is
tested end to end in test_bench.py)."""
import pytest

import eval.bench.sweep as sweep
from eval.bench.cli import BenchSettings


def fake_result(mfs_s: float, base_s: float, paired: float | None, ceiling: float | None = None) -> dict:
    systems = {"mfs": {"mean_token_latency_s": mfs_s, "num_requests": 3}, "baseline": {"mean_token_latency_s": base_s}}
    return {"systems": systems, "reductions_vs_baseline": {"mfs": 1 - mfs_s / base_s},
            "paired_vs_baseline": {"mfs": {"reduction_mean_token_latency": paired}},
            "reduction_ceiling": {"mfs": ceiling}, "notes": []}


def test_seeds_run_the_base_setting_once_per_seed_and_report_the_spread(monkeypatch):
    seen = []
    outcomes = {0: fake_result(0.9, 1.0, 0.2, 0.5), 1: fake_result(1.1, 1.0, None, 0.45),
                5: fake_result(0.6, 1.0, 0.4, 0.6)}

    def run_bench(settings):
        seen.append((settings.seed, settings.rate, settings.kv_pages))
        return outcomes[settings.seed]

    monkeypatch.setattr(sweep, "run_bench", run_bench)
    base = BenchSettings(rate=0.5, kv_pages=768, seed=9)
    out = sweep.run_sweep(base, rates=[], kv_pages=[], ample_pages=None, thresholds=[], seeds=[0, 1, 5], log=lambda m: None)
    assert seen == [(0, 0.5, 768), (1, 0.5, 768), (5, 0.5, 768)]   # the base setting, only the seed changes
    assert [r["seed"] for r in out["seeds"] if r["system"] == "mfs"] == [0, 1, 5]
    spread = out["seed_spread"]["mfs"]
    assert spread["reduction_vs_baseline"]["n"] == 3
    assert spread["reduction_vs_baseline"]["mean"] == pytest.approx((0.1 - 0.1 + 0.4) / 3)
    assert spread["reduction_vs_baseline"]["min"] == pytest.approx(-0.1)
    assert spread["reduction_vs_baseline"]["max"] == pytest.approx(0.4)
    # a seed with no paired figure is left out of the paired spread, not counted as zero
    assert spread["paired_reduction_vs_baseline"]["n"] == 2
    assert spread["paired_reduction_vs_baseline"]["mean"] == pytest.approx(0.3)
    assert spread["reduction_ceiling"]["n"] == 3 and spread["reduction_ceiling"]["min"] == pytest.approx(0.45)
    assert [r["reduction_ceiling"] for r in out["seeds"] if r["system"] == "mfs"] == [0.5, 0.45, 0.6]
    assert "baseline" not in out["seed_spread"]


def test_no_seeds_no_spread(monkeypatch):
    monkeypatch.setattr(sweep, "run_bench", lambda s: pytest.fail("nothing should run"))
    out = sweep.run_sweep(BenchSettings(), rates=[], kv_pages=[], ample_pages=None, thresholds=[], log=lambda m: None)
    assert out["seeds"] == [] and out["seed_spread"] == {}


def test_cli_parses_seeds_and_base_setting(monkeypatch, tmp_path, capsys):
    calls = []

    def run_sweep(base, rates, kv_pages, ample, thresholds, seeds, log, run=None):
        calls.append((base.rate, base.kv_pages, rates, kv_pages, ample, seeds))
        return {"grid": [], "single_ample": [], "escalation": [], "seeds": [], "seed_spread": {}, "notes": [],
                "settings": {}}

    monkeypatch.setattr(sweep, "run_sweep", run_sweep)
    out = tmp_path / "s.json"
    assert sweep.main(["--rates=", "--kv-pages=", "--ample-pages", "0", "--seeds", "0,1,2", "--base-rate", "2",
                       "--base-kv-pages", "512", "--out", str(out)]) == 0
    assert calls == [(2.0, 512, [], [], None, [0, 1, 2])]
    assert out.is_file()


def test_cli_rejects_seeds_that_are_not_integers(capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main(["--seeds", "0,1.5"])
    assert exc.value.code == 2
    assert "comma-separated integers" in capsys.readouterr().err


def test_the_sweep_command_runs_each_bench_as_mfs_bench_does(monkeypatch):
    """python -m eval.commands.sweep: the bench with the baseline split's simulated pilot (eval/commands/bench.py)."""
    import eval.commands.bench as bench_command
    import eval.commands.sweep as sweep_command

    seen = {}
    monkeypatch.setattr(sweep, "main", lambda argv, run=None: seen.update(argv=argv, run=run) or 0)
    assert sweep_command.main(["--quick"]) == 0
    assert seen == {"argv": ["--quick"], "run": bench_command.run_bench}
