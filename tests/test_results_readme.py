"""benchmarks/results/README.md quotes its files exactly: each compare output's command, commit, date and table
as the JSON holds them, each confirmation's medians as ``confirm.json`` holds them. A number edited by hand, or a
file re-measured without its section, fails here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
README = (RESULTS / "README.md").read_text()
QUOTED = re.compile(r"^`([\w/.-]+\.json)`(?: — ([^\n]*))?\. Commit `(\w+)`, (\S+)\.\n\n```\n(.*?)\n```\n", re.M | re.S)


def _quotes() -> list[tuple[str, str, str, str, str, str]]:
    """(file, its note after the dash, commit, date, command, the README from the end of the command on) of each
    quoted output."""
    found = []
    for match in QUOTED.finditer(README):
        name, note, commit, date, command = match.groups()
        found.append((name, note or "", commit, date.rstrip("."), command, README[match.end() :]))
    return found


def _is_compare_output(path: Path) -> bool:
    data = json.loads(path.read_text())
    return isinstance(data, dict) and {"command", "git_commit", "table"} <= data.keys()


def test_every_compare_output_is_quoted():
    quoted = {q[0] for q in _quotes()}
    outputs = {p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*.json") if _is_compare_output(p)}
    assert outputs and outputs - quoted == set()


@pytest.mark.parametrize(
    "name, note, commit, date, command, after",
    _quotes(),
    ids=lambda v: v if v.endswith(".json") and " " not in v else None,
)
def test_a_quoted_output_matches_its_file(name, note, commit, date, command, after):
    """The command, commit and date as the file holds them, and its table (the file's first block: a summary
    the script prints under it may be left to the prose) as the next block starting with the table's head. A run
    cut off before its end (``complete: false``) says so in its note: ``name.json`` — cut off ...."""
    data = json.loads((RESULTS / name).read_text())
    assert (commit, date, command) == (data["git_commit"], data["date"], data["command"])
    assert data.get("complete", True) or note.startswith("cut off"), f"{name}: cut off, and not quoted as such"
    table = data["table"].strip().split("\n\n")[0]
    head = table.splitlines()[0]
    assert head in after, f"{name}: its table is not quoted after its command"
    assert after[after.index(head) :].split("\n\n")[0].strip() == table


@pytest.mark.parametrize("study", ["h200_single_small", "h200_proxy", "h200_small_s1664", "h200_small_fused"])
def test_confirmation_medians_match_their_file(study):
    """The study's confirmation table, up to the next blank line after it: its winner in the heading, one row per
    candidate with the file's median."""
    record = json.loads((RESULTS / study / "confirm.json").read_text())
    heading = README.index(f"Confirmation (`{study}/confirm.json`")
    assert README[heading : README.index("\n", heading)].endswith(f"winner trial #{record['winner']}):")
    table = README[heading:].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("#")]
    assert len(rows) == len(record["candidates"]), table
    for candidate in record["candidates"]:
        median = f"{100 * candidate['median_values'][0]:.2f}" if candidate.get("median_values") else "-"
        assert re.search(rf"^#{candidate['trial']} \| [^|]+ \| [^|]+ \| {re.escape(median)} \|", table, re.M)
