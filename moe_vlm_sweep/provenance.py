"""Which code made a result: the installed package's version and, from a git checkout only, its commit.

An installed wheel has no commit to report; a checkout's commit is taken only when the package's own files are
tracked there, so a wheel installed into a virtualenv that happens to sit inside some repository is not credited
with that repository's commit.
"""

from __future__ import annotations

import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def package_version() -> str:
    try:
        return version("moe-vlm-sweep")
    except PackageNotFoundError:  # imported from a checkout that was never installed
        return "unknown"


def git_commit() -> str | None:
    """The checkout's HEAD if this package's files are tracked in it, else None."""
    try:
        tracked = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR), "ls-files", "--error-unmatch", "__init__.py"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if tracked.returncode != 0:
            return None
        head = subprocess.run(
            ["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        return head.stdout.strip() if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance_tags(prefix: str) -> dict[str, str]:
    """``{prefix}version`` always, ``{prefix}git_commit`` from a checkout."""
    commit = git_commit()
    return {f"{prefix}version": package_version(), **({f"{prefix}git_commit": commit} if commit else {})}
