"""The project speaks of the project alone: no tracked file talks about the machines or the process it was
developed with. Each pattern is narrow enough to leave the project's own words alone:

- ``session``: as a word (``start_new_session``, Python's keyword, is part of a name and not matched; a POSIX
  process session is called a process group here; pytest's ``scope="session"`` is its API, not a word).
- ``lease`` and its forms, as words (``release`` is not matched).
- ``device call``.
- ``refused`` of a machine request (``refused call``, ``request was refused``); a config the rules reject may be
  called refused.
- a machine's budget (``GPU budget``, ``device time budget``, ``budget_left``); ``sweep.time_budget_s``, a
  sweep's own wall-clock limit, is a knob of the project.
- ``.kit`` and ``.whl`` as folder names (``*.whl``, a wheel's file name, is matched by neither).
- ``/tmp/site``.
- ``the issue``.

Recorded outputs under ``benchmarks/results/`` (JSON, logs, tables: every file there but its README) are kept
byte for byte as the runs wrote them, tracebacks included, and are not searched.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERNS = {
    "session": r"(?<!scope=\")\bsessions?\b(?!\")",
    "lease": r"\blease[sd]?\b|\bleasing\b",
    "device call": r"\bdevice calls?\b",
    "refused machine request": r"\brefused (?:device |machine |GPU )?(?:calls?|requests?|starts?)\b"
    r"|\b(?:calls?|requests?) (?:was |were )?refused\b",
    "machine budget": r"\b(?:device|GPU|machine|H100|H200)(?: time)? budget\b|\bbudget_left\b"
    r"|\bbudget of (?:a|the) (?:machine|device|GPU)\b",
    ".kit": r"(?<![\w*.-])\.kit\b",
    ".whl": r"(?<![\w*.-])\.whl\b",
    "/tmp/site": r"/tmp/site\b",
    "the issue": r"\bthe issue\b",
}
WORDS = re.compile("|".join(f"(?P<p{i}>{p})" for i, p in enumerate(PATTERNS.values())), re.IGNORECASE)


def _searched() -> list[str]:
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    recorded = [f for f in files if f.startswith("benchmarks/results/") and f != "benchmarks/results/README.md"]
    return [f for f in files if f not in recorded and f != "tests/test_vocabulary.py"]


def test_no_tracked_file_speaks_of_how_the_project_was_made():
    hits = []
    for name in _searched():
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            for match in WORDS.finditer(line):
                hits.append(f"{name}:{number}: {match.group(0)!r} in {line.strip()[:120]}")
    assert hits == [], "\n".join(hits)


def test_the_patterns_leave_the_projects_own_words_alone():
    legit = [
        "start_new_session=True",
        '@pytest.fixture(scope="session")',
        "a release of TE",
        "sweep.time_budget_s=3500",
        "the rules refused batch.mbs=3",
        "pip wheel -w dist && ls dist/*.whl",
        "mypkg-1.0.whl",
        "toolkit",
    ]
    caught = [
        "a GPU lease",
        "the fifth session",
        "nineteen refused calls",
        "GPU budget",
        "bash .kit/install.sh",
        "PYTHONPATH=/tmp/site:x",
        "the issue's baseline",
        "one device call",
        "carrying .whl",
    ]
    assert [t for t in legit if WORDS.search(t)] == []
    assert [t for t in caught if not WORDS.search(t)] == []
