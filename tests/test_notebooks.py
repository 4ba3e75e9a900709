"""Executes the eval notebooks with nbclient on one small results JSON from a real (tiny) bench run, and
once more each with no parameters at all, the way a user opens them.

The results file comes from run_bench on 2 sessions at 2 rates (a curve; once per test session). The
sweep file is built from that same run's rows (one grid point, one escalation point at the default
threshold): real measurements in the sweep schema, so the sweep cells render without running a sweep in CI.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "eval" / "notebooks"
REPO = NOTEBOOKS.parent.parent


@pytest.fixture(scope="session")
def bench_files(tmp_path_factory):
    from eval.bench.cli import BenchSettings
    from eval.commands.bench import run_bench
    from eval.bench.sweep import rows_of
    from tests.test_workloads import family_dir

    out = tmp_path_factory.mktemp("bench")
    settings = BenchSettings(sessions=2, rate=2.0, kv_pages=512, family=str(family_dir()), max_turns=2,
                             max_prompt_tokens=256, max_output_tokens=8, think_s=0.2, progress=False,
                             rates=(2.0, 8.0))
    result = run_bench(settings)
    results_path = out / "results.json"
    results_path.write_text(json.dumps(result))
    mfs_only = {**result, "systems": {"mfs": result["systems"]["mfs"]}}
    sweep = {"grid": rows_of(result, workload="multiturn", rate=settings.rate, kv_pages=settings.kv_pages),
             "single_ample": [], "escalation": rows_of(mfs_only, threshold=0.3, rate=settings.rate,
                                                      kv_pages=settings.kv_pages), "notes": [], "settings": {}}
    sweep_path = out / "sweep.json"
    sweep_path.write_text(json.dumps(sweep))
    return results_path, sweep_path


NAMES = ["latency_vs_load", "latency_vs_baseline", "cache_hit_rates", "escalation"]


def run_notebook(name: str, parameters: dict | None, cwd: Path):
    """parameters None: the notebook as it is, nothing injected (a user opening it)."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    if parameters is not None:
        index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in parameters.items()))
        injected.metadata["tags"] = ["injected-parameters"]   # papermill's convention
        nb.cells.insert(index + 1, injected)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def errors_of(nb) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]


def test_every_notebook_is_tested():
    # simulation.ipynb reads mfs simulate output, not the bench's: its own test below
    assert sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")) == sorted([*NAMES, "simulation"])


def test_the_fallback_bench_runs_the_family_a_notebook_names():
    """Every bench notebook names the family its fallback bench runs (a parameter: the nested "tiny" by default,
    "tiny-sep" for the separate-weight one) and hands it to load_results."""
    import nbformat

    from eval.bench.notebook_data import fallback_settings

    assert fallback_settings().family == "tiny" and fallback_settings("tiny-sep").family == "tiny-sep"
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        parameters = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        assert 'fallback_family = "tiny"' in parameters, name
        assert any("load_results(results_path, fallback_family)" in c.source for c in nb.cells), name


@pytest.mark.slow
def test_a_notebook_reads_a_separate_family_bench(tmp_path):
    """latency_vs_load on a bench of the separate-weight family (tiny-sep): nothing in it assumes the nested one."""
    from eval.bench.cli import BenchSettings
    from eval.commands.bench import run_bench

    settings = BenchSettings(sessions=2, rate=2.0, kv_pages=512, family="tiny-sep", max_turns=2,
                             max_prompt_tokens=128, max_output_tokens=6, think_s=0.1, progress=False,
                             rates=(2.0, 8.0), score_quality=False)
    results_path = tmp_path / "results.json"
    results_path.write_text(json.dumps(run_bench(settings)))
    nb = run_notebook("latency_vs_load", {"results_path": str(results_path), "figures_dir": str(tmp_path / "fig")},
                      REPO)
    assert not errors_of(nb), [e.get("evalue") for e in errors_of(nb)]
    assert list((tmp_path / "fig").glob("*.png"))


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes(name, bench_files, tmp_path):
    results_path, sweep_path = bench_files
    figures = tmp_path / "figures"
    params = {"results_path": str(results_path), "figures_dir": str(figures)}
    if name in ("latency_vs_baseline", "escalation"):
        params["sweep_path"] = str(sweep_path)
    nb = run_notebook(name, params, REPO)
    assert not errors_of(nb)
    assert list(figures.glob("*.png")), "the notebook saved no figure"
    if name == "latency_vs_load":
        text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
        assert "capacity at the SLO, mfs" in text and "knee:" in text and "SIMULATED pilot" in text


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes_with_no_parameters(name, monkeypatch):
    """Opened as a user opens it: a Jupyter kernel (a running event loop), no parameters, no results file
    next to it: the fallback runs a tiny bench inside the kernel's loop (asyncio.run() alone fails there)."""
    assert not (NOTEBOOKS / "results.json").exists(), "remove eval/notebooks/results.json: this test needs none"
    monkeypatch.setenv("PYTHONPATH", str(REPO))          # the kernel imports this tree's code
    nb = run_notebook(name, None, NOTEBOOKS)
    assert not errors_of(nb), [e.get("evalue") for e in errors_of(nb)]
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    assert "not found: running a tiny bench" in text


@pytest.mark.slow
def test_simulation_notebook_executes(tmp_path):
    """simulation.ipynb on a quick simulated curve of the tiny family (its measured step table: seconds)."""
    import argparse

    from eval.simulate.cli import add_arguments, run_simulation

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    result = run_simulation(parser.parse_args(["--family", str(REPO / "engines" / "families" / "tiny"), "--quick",
                                               "--sessions", "4", "--rates", "0.5,2", "--no-progress"]))
    assert result["simulated"]["cost_model"]["name"] == "measured" and [p["rate"] for p in result["curve"]] == [0.5, 2.0]
    path = tmp_path / "sim.json"
    path.write_text(json.dumps(result))
    figures = tmp_path / "figures"
    nb = run_notebook("simulation", {"sim_paths": [str(path)], "figures_dir": str(figures)}, REPO)
    assert not errors_of(nb)
    assert (figures / "sim_curve.png").is_file() and (figures / "hit_rates_by_tier.png").is_file()


@pytest.mark.slow
def test_simulation_notebook_reads_the_shipped_results(tmp_path):
    """Its default sim_paths are result files kept under docs/results (docs/results/README.md): each one loads,
    none falls back to a fresh simulation."""
    nb = run_notebook("simulation", {"figures_dir": str(tmp_path / "figures")}, REPO)
    assert not errors_of(nb), [e.get("evalue") for e in errors_of(nb)]
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    assert "not found" not in text
    assert "qwen3_1.7b_8b_32b_h200_fair_seed0 ->" in text
