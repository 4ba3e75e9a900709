"""docs/results holds only indexed files, and every result file the docs name exists.

docs/results/README.md lists each kept file (digits of a seed, trace or repetition may stand as S, T, N); the
docs name files as paths under docs/results/, with shell braces ({0..6}, {0,1}), globs and those placeholders
allowed. The old folders (docs/bench, docs/sim) are named only as history (`git show COMMIT:docs/bench/`)."""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", RESULTS / "README.md"]


def _expand_braces(text: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", text)
    if not match:
        return [text]
    body = match.group(1)
    if ".." in body:
        low, high = body.split("..")
        options = [str(i) for i in range(int(low), int(high) + 1)]
    else:
        options = body.split(",")
    return list(itertools.chain.from_iterable(
        _expand_braces(text[:match.start()] + option + text[match.end():]) for option in options))


def _placeholders(name: str) -> set[str]:
    forms = {name}
    for pattern, placeholder in ((r"seed\d+", "seedS"), (r"trace\d+", "traceT"), (r"rep\d+", "repN")):
        forms |= {re.sub(pattern, placeholder, f) for f in forms}
    return forms


def test_every_kept_file_is_indexed():
    index = (RESULTS / "README.md").read_text()
    files = sorted(p for p in RESULTS.rglob("*") if p.is_file() and p.name != "README.md")
    assert files, "docs/results is empty"
    for path in files:
        # result JSON, and a run's plot beside its JSON
        assert path.suffix == ".json" or (path.suffix == ".png" and path.with_suffix(".json").is_file()), \
            f"{path.name}: only result JSON (and a plot beside it) belongs in docs/results"
        assert any(form in index for form in _placeholders(path.name)), f"{path.name} is not in docs/results/README.md"
        if path.suffix == ".json":
            json.loads(path.read_text())


def test_every_result_file_the_docs_name_exists():
    named = 0
    for doc in DOCS:
        for reference in re.findall(r"docs/results/[\w./{},*-]+\.json", doc.read_text()):
            for path in _expand_braces(reference):
                for placeholder, wildcard in (("seedS", "seed*"), ("traceT", "trace*"), ("repN", "rep*")):
                    path = path.replace(placeholder, wildcard)
                assert list(REPO.glob(path)), f"{doc.relative_to(REPO)} names {path}, which does not exist"
                named += 1
    assert named


def test_no_reference_to_the_old_result_folders():
    for doc in [*DOCS, REPO / "eval" / "notebooks" / "simulation.ipynb"]:
        text = re.sub(r"\b[0-9a-f]{7,40}:docs/", "", doc.read_text())   # `git show COMMIT:docs/bench/` is history
        assert "docs/bench/" not in text and "docs/sim/" not in text, f"{doc.relative_to(REPO)} names a removed folder"
