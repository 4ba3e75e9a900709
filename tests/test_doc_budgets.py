"""The documentation's budgets: README.md at most 150 lines, docs/BENCHMARKS.md at most 30,000 bytes, every file
under docs/ together at most 5 MiB. The docs state what MFS is and measures, not how it was developed: none of a
short list of development-history phrases appears. "56.1%" is the reference's claim (the published result MFS is
compared with) and is named so wherever it appears in README.md and docs/BENCHMARKS.md."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS_DIR = REPO / "docs"
BENCHMARKS = DOCS_DIR / "BENCHMARKS.md"
DOCS = [README, *sorted(DOCS_DIR.glob("*.md")), DOCS_DIR / "results" / "README.md"]

MAX_README_LINES = 150
MAX_BENCHMARKS_BYTES = 30_000
MAX_DOCS_BYTES = 5 * 1024 * 1024

# Phrases that only ever describe how the project was developed, never what it is.
HISTORY_PHRASES = ("this vm", "this session", "lent device", "device machine", "at hand", "last week",
                   "this round", "earlier round", "previous round", "next round", "issue #")
# "this machine" is the user's machine in docs/CLI.md (generated from the parsers); the results docs name the
# hardware a run recorded instead.
RESULTS_HISTORY_PHRASES = ("this machine", "this box")

REFERENCE_FIGURE = "56.1%"


def history_phrases_in(text: str, phrases: tuple[str, ...] = HISTORY_PHRASES) -> list[str]:
    """The phrases of `phrases` that occur in `text` as words (case-insensitive)."""
    lowered = text.lower()
    return [p for p in phrases if re.search(r"(?<!\w)" + re.escape(p) + r"(?!\w)", lowered)]


def units(text: str) -> list[str]:
    """Paragraphs (blank-line separated), with every table row a unit of its own."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        rows = [line for line in block.splitlines() if line.lstrip().startswith("|")]
        rest = "\n".join(line for line in block.splitlines() if not line.lstrip().startswith("|"))
        found.extend(rows)
        if rest.strip():
            found.append(rest)
    return found


def unnamed_reference_figures(text: str) -> list[str]:
    """Units holding 56.1% that do not name it as the reference's: the first must say "reference's claim", every
    other at least "reference"."""
    holding = [" ".join(u.split()) for u in units(text) if REFERENCE_FIGURE in u]   # lines joined
    bad = [u for u in holding if "reference" not in u.lower()]
    if holding and "reference's claim" not in holding[0].lower() and holding[0] not in bad:
        bad.insert(0, holding[0])
    return bad


def test_readme_fits_its_line_budget():
    num_lines = len(README.read_text().splitlines())
    assert num_lines <= MAX_README_LINES, f"README.md has {num_lines} lines, budget {MAX_README_LINES}: details " \
                                          "belong in docs/"


def test_benchmarks_fits_its_byte_budget():
    size = BENCHMARKS.stat().st_size
    assert size <= MAX_BENCHMARKS_BYTES, f"docs/BENCHMARKS.md is {size:,} bytes, budget {MAX_BENCHMARKS_BYTES:,}: " \
                                         "keep current results only (git keeps the rest)"


def test_docs_fit_their_size_budget():
    files = [p for p in DOCS_DIR.rglob("*") if p.is_file()]
    total = sum(p.stat().st_size for p in files)
    largest = sorted(files, key=lambda p: p.stat().st_size, reverse=True)[:5]
    assert total <= MAX_DOCS_BYTES, (
        f"docs/ holds {total:,} bytes, budget {MAX_DOCS_BYTES:,}; largest: "
        + ", ".join(f"{p.relative_to(REPO)} ({p.stat().st_size:,})" for p in largest)
        + ". Keep only result files a doc cites (docs/results/README.md)")


def test_no_development_history_in_the_docs():
    for doc in DOCS:
        found = history_phrases_in(doc.read_text())
        assert not found, f"{doc.relative_to(REPO)} says {found}: state what is, not how it was developed"
    for doc in (README, BENCHMARKS, DOCS_DIR / "results" / "README.md"):
        found = history_phrases_in(doc.read_text(), RESULTS_HISTORY_PHRASES)
        assert not found, f"{doc.relative_to(REPO)} says {found}: name the hardware (e.g. 2 CPU cores)"


def test_the_reference_figure_is_named_as_the_references_claim():
    for doc in (README, BENCHMARKS):
        bad = unnamed_reference_figures(doc.read_text())
        assert not bad, f"{doc.relative_to(REPO)}: {REFERENCE_FIGURE} not named as the reference's claim in {bad}"


def test_the_checks_catch_what_they_should():
    assert history_phrases_in("Measured on this VM last week.") == ["this vm", "last week"]
    assert history_phrases_in("The 4 sessions/s run of this session's trace: At hand.") == ["this session", "at hand"]
    assert history_phrases_in("three paired rounds; a round robin; the session's member; the thread at handover") \
        == []
    assert history_phrases_in("a table of this machine", RESULTS_HISTORY_PHRASES) == ["this machine"]

    named = "The reference's\nclaim: 56.1% lower token generation latency.\n\n| row | 58.3% above the reference's 56.1% |"
    assert unnamed_reference_figures(named) == []
    assert unnamed_reference_figures("MFS misses 56.1% here.") == ["MFS misses 56.1% here."]
    first_unnamed = "MFS is near 56.1%.\n\nThe reference's claim is 56.1%."
    assert unnamed_reference_figures(first_unnamed) == ["MFS is near 56.1%."]
    later_unnamed = "The reference's claim is 56.1%.\n\n| setting | 56.1% needed |"
    assert unnamed_reference_figures(later_unnamed) == ["| setting | 56.1% needed |"]
    assert unnamed_reference_figures("no figure here") == []
