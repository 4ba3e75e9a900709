"""What the eval notebooks read: the bench results JSON they are given, or, when there is none (a user opens
a notebook in Jupyter with no parameters), a tiny bench run in-process. The kernel already runs an event
loop; run_bench copes (eval.bench.cli.run_coroutine runs the replay on its own thread then)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Small enough for a notebook opened cold (about a minute on 2 busy cores), still a 2-rate curve of
# closed-loop sessions against the baseline. The traffic split skips the baseline's pilot run and search.
FALLBACK = dict(sessions=3, max_turns=2, max_prompt_tokens=256, max_output_tokens=16, rates=(1.0, 4.0),
                baseline_split="traffic")


def fallback_settings(family: str = "tiny"):
    """The fallback bench's settings, on `family` (a shipped family name or directory: the nested "tiny", the
    separate-weight "tiny-sep")."""
    from eval.bench.cli import BenchSettings

    return BenchSettings.quick_defaults(progress=False, score_quality=True, family=family, **FALLBACK)


def load_results(path: str | Path | None, family: str = "tiny") -> dict[str, Any]:
    """The bench JSON at `path`; when it is missing, a tiny bench (mfs, baseline) on `family`, said in one line."""
    target = Path(path) if path else None
    if target is not None and target.is_file():
        return json.loads(target.read_text())
    from eval.bench.cli import run_bench

    print(f"{target} not found: running a tiny bench (mfs, baseline on {family}; {FALLBACK})")
    return run_bench(fallback_settings(family))
