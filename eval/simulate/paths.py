"""Files the simulator ships, found from its sources (kept out of the compiled modules: an extension's
__file__ lies in the build folder, eval/simulate/compiled.py)."""
from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_LIBRARY = HERE / "data" / "tiny_confidences.json"     # per-token confidences recorded from the tiny family
TABLES_DIR = HERE / "tables"                                  # step tables, fitted models, acceptance tables
