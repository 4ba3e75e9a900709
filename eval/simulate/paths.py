"""Files the simulator ships, found from its sources (kept out of the compiled modules: an extension's
__file__ lies in the build folder, eval/simulate/compiled.py). A family run on this machine's measured cost
model has files of its own, named by its family.yaml name: <family>_measured.json (the engine timed offline,
eval.simulate.measure), <family>_fitted.json (fitted to real bench steps), <family>_speculation.json (draft
acceptance) under tables/, and data/<family>_confidences.json (recorded per-token confidences)."""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_LIBRARY = HERE / "data" / "tiny_confidences.json"     # per-token confidences recorded from the tiny family
TABLES_DIR = HERE / "tables"                                  # step tables, fitted models, acceptance tables


def measured_table_path(family_name: str) -> Path:
    """The family's step table, its engine timed offline on a grid on this machine (eval.simulate.measure)."""
    return TABLES_DIR / f"{family_name}_measured.json"


def fitted_model_path(family_name: str) -> Path:
    """The family's linear cost model fitted to real bench steps (eval.validate.bench_vs_sim)."""
    return TABLES_DIR / f"{family_name}_fitted.json"


def speculation_table_path(family_name: str) -> Path:
    """The family's measured draft acceptance (eval.simulate.measure_speculation)."""
    return TABLES_DIR / f"{family_name}_speculation.json"


def confidences_path(family_name: str) -> Path:
    """The family's recorded per-token confidences (mfs bench --record-confidences, merged)."""
    return HERE / "data" / f"{family_name}_confidences.json"


def shown(path: Path) -> str:
    """`path` as a command run from the repository root names it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def measure_command(family: str, family_name: str) -> str:
    """The command that measures `family`'s step table (family: as given on the command line, a shipped name
    or a directory; family_name: its family.yaml name, which names the table)."""
    return f"python -m eval.simulate.measure --family {family} --out {shown(measured_table_path(family_name))}"
