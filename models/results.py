"""Result files: one schema for every measurement the project publishes.

    {"device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "commit": "ab049e0",
     "command": "oscar bench ...", "date": "2026-12-06T10:00:00+00:00", "rows": [...]}

Each row names what it measured (shape, scheme, bits/element) beside its numbers; files
live under `bench/results/<device slug>/`, named for what they measure.
"""

from __future__ import annotations

import datetime
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import jax


def device_name() -> str:
    """The first device's kind, e.g. "NVIDIA H200" or "cpu"."""
    return jax.devices()[0].device_kind


def device_slug(name: str | None = None) -> str:
    """A short folder name for a device: "h100", "h200", "cpu", else the kind in lower case."""
    name = (name or device_name()).lower()
    for known in ("h100", "h200", "a100", "l4", "v5e", "v5p", "v6e"):
        if known in name:
            return known
    return "cpu" if name == "cpu" else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def commit() -> str:
    """The checkout's commit (short hash, "-dirty" when files differ from it), or "unrecorded"."""
    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unrecorded"
    return (head + ("-dirty" if dirty else "")) if head else "unrecorded"


def record(rows: list[dict], command: str | None = None) -> dict:
    """The schema's dict for `rows`; command defaults to this process's command line."""
    return {"device": device_name(), "jax": jax.__version__, "commit": commit(),
            "command": command or shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rows": rows}


def write(result: dict, path: str | Path) -> Path:
    """Write `result` (from `record`) as indented JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path
