"""Executes the eval notebooks with nbclient on one small results JSON from a real (tiny) bench run.

The results file comes from run_bench on 2 sessions (once per test session). The sweep file is built
from that same run's rows (one grid point, one escalation point at the default threshold): real
measurements in the sweep schema, so the sweep cells render without running a sweep in CI.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "eval" / "notebooks"
REPO = NOTEBOOKS.parent.parent


@pytest.fixture(scope="session")
def bench_files(tmp_path_factory):
    from eval.bench import BenchSettings, run_bench
    from eval.sweep import rows_of
    from tests.test_workloads import family_dir

    out = tmp_path_factory.mktemp("bench")
    settings = BenchSettings(sessions=2, rate=2.0, kv_pages=512, family=str(family_dir()), max_turns=2,
                             max_prompt_tokens=256, max_output_tokens=8, think_s=0.2, progress=False)
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


def run_notebook(name: str, parameters: dict, cwd: Path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    index = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    injected = nbformat.v4.new_code_cell("\n".join(f"{k} = {v!r}" for k, v in parameters.items()))
    injected.metadata["tags"] = ["injected-parameters"]   # papermill's convention
    nb.cells.insert(index + 1, injected)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


@pytest.mark.slow
@pytest.mark.parametrize("name", ["latency_vs_baseline", "cache_hit_rates", "escalation"])
def test_notebook_executes(name, bench_files, tmp_path):
    results_path, sweep_path = bench_files
    figures = tmp_path / "figures"
    params = {"results_path": str(results_path), "figures_dir": str(figures)}
    if name != "cache_hit_rates":
        params["sweep_path"] = str(sweep_path)
    nb = run_notebook(name, params, REPO)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert list(figures.glob("*.png")), "the notebook saved no figure"


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
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    assert (figures / "sim_curve.png").is_file() and (figures / "hit_rates_by_tier.png").is_file()
