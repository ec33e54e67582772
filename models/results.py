"""Result records: the one JSON schema of every file under bench/results/.

    {"device": "NVIDIA H200", "jax": "0.11.2", "commit": "dae93b8", "command": "python bench/kernels.py ...",
     "date": "2026-12-06", "rows": [{...}, ...]}

`device` is the JAX device kind ("cpu" on the CPU); `commit` the git commit of the tree that
ran (`OSCAR_COMMIT` overrides it, e.g. on a machine given a copy of the tree without .git;
"-dirty" marks uncommitted changes to tracked files; "unrecorded" when neither is known);
`command` the command line; `date` the UTC date (YYYY-MM-DD). Each row names what it
measured (its shape or scheme, bits/element) and the numbers. A file that collects several
calls holds their command lines joined by " ; ", and each of its rows names its own
`command`. Files live in bench/results/<device folder>/, named for what they measure.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax

KEYS = ("device", "jax", "commit", "command", "date", "rows")
UNRECORDED = "unrecorded"


def device_kind() -> str:
    """The JAX device kind of the default backend ("cpu" on the CPU)."""
    return "cpu" if jax.default_backend() == "cpu" else jax.devices()[0].device_kind


def device_folder(kind: str) -> str:
    """bench/results/ folder of a device kind: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" ->
    "h100", "cpu" -> "cpu", other kinds their lower-case words joined by "-"."""
    words = kind.split()
    if words and words[0] == "NVIDIA" and len(words) > 1:
        return words[1].lower()
    return re.sub(r"[^a-z0-9]+", "-", kind.lower()).strip("-") or "unknown"


def commit() -> str:
    """`OSCAR_COMMIT`, else the short hash of the git tree this module is in (+ "-dirty" with
    uncommitted changes to tracked files), else "unrecorded"."""
    if os.environ.get("OSCAR_COMMIT"):
        return os.environ["OSCAR_COMMIT"]
    root = Path(__file__).resolve().parent
    try:
        git = lambda *a: subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True,
                                        check=True, timeout=10).stdout.strip()
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return UNRECORDED


def command_line() -> str:
    """This process's command line as typed: `python SCRIPT.py ARGS` for a script, a console
    script (`oscar bench ...`) by its name."""
    script = sys.argv[0]
    head = ["python", script] if script.endswith(".py") else [os.path.basename(script)]
    return " ".join([*head, *sys.argv[1:]])


def record(rows: list[dict], command: str | None = None) -> dict:
    """A record of `rows` measured now on this process's device; `command` defaults to the
    process's own command line."""
    return {"device": device_kind(), "jax": jax.__version__, "commit": commit(),
            "command": command if command is not None else command_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "rows": rows}


def check(rec: dict, where: str = "record") -> dict:
    """`rec` if it has exactly the schema's keys and a list of dict rows, else ValueError."""
    if not isinstance(rec, dict) or set(rec) != set(KEYS):
        got = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
        raise ValueError(f"{where}: expected the keys {list(KEYS)}, got {got}")
    if not isinstance(rec["rows"], list) or not all(isinstance(r, dict) for r in rec["rows"]):
        raise ValueError(f"{where}: 'rows' must be a list of objects")
    return rec


def write(path: str | os.PathLike, rec: dict) -> Path:
    """Write `rec` to `path` whole (a kill mid-write leaves the previous file), making folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(check(rec, str(path)), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read(path: str | os.PathLike) -> dict:
    """The record at `path`, checked against the schema."""
    return check(json.loads(Path(path).read_text()), str(path))


def default_path(results_dir: str | os.PathLike, name: str) -> Path:
    """results_dir/<this device's folder>/<name>.json."""
    return Path(results_dir) / device_folder(device_kind()) / f"{name}.json"
