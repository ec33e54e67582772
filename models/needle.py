"""Long-context retrieval: a passkey hidden at a depth of filler text, read back by
greedy decoding through the decode loop (prefill -> cache -> `decode`).

Adds the `oscar needle` command. Accuracy is per (context length, depth): the
fraction of trials whose generated text contains the passkey's digits.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np
import typer
from rich.table import Table

from oscar_jax.models import cli
from oscar_jax.models import generate as gen
from oscar_jax.models import results as results_io
from oscar_jax.models.cli import app, console, load_calibration
from oscar_jax.models.evaluate import SCHEMES, scheme_policy

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"
NEW_TOKENS = 8  # greedy tokens decoded after each prompt


def needle_prompt(tokenizer, length: int, depth: float, passkey: int) -> list[int]:
    """Token ids of about `length` tokens: filler with the passkey sentence inserted
    after `depth` (0..1) of it, then the question. The filler is cut at token level."""
    if not 0 <= depth <= 1:
        raise ValueError(f"depth={depth}: expected in [0, 1]")
    needle = tokenizer.encode(f" The pass key is {passkey}. Remember it. {passkey} is the pass key. ",
                              add_bos=False)
    question = tokenizer.encode(QUESTION, add_bos=False)
    head = tokenizer.encode("", add_bos=None)  # BOS where the model wants one
    unit = tokenizer.encode(FILLER, add_bos=False)
    room = length - len(head) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"length={length} is too short for the needle and the question")
    filler = (unit * (room // len(unit) + 1))[:room]
    cut = int(round(depth * room))
    return head + filler[:cut] + needle + filler[cut:] + question


@dataclasses.dataclass(frozen=True)
class NeedleResult:
    kv: str
    length: int
    depth: float
    accuracy: float
    trials: int
    bpe: float


def run(model, tokenizer, policy, name: str, lengths, depths, trials: int, seed: int = 0) -> list[NeedleResult]:
    """Greedy retrieval for each (length, depth), `trials` random 5-digit passkeys each,
    batched over trials."""
    from oscar_jax.models import kv_policy

    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        for depth in depths:
            keys = rng.integers(10000, 100000, trials)
            prompts = [needle_prompt(tokenizer, length, depth, int(k)) for k in keys]
            res = gen.generate(model, policy, prompts, max_new_tokens=NEW_TOKENS, key=jax.random.key(seed))
            hits = [str(k) in tokenizer.decode(t) for k, t in zip(keys, res.tokens)]
            out.append(NeedleResult(name, length, depth, float(np.mean(hits)), trials,
                                    kv_policy.bits_per_element(res.kv)))
    return out


def parse_lengths(text: str) -> list[int]:
    """"1K,2K,4096" -> [1024, 2048, 4096] (K = 1024); ValueError unless every entry is a
    positive token count."""
    vals = []
    for part in text.split(","):
        entry = part.strip().upper()
        try:
            n = int(float(entry[:-1]) * 1024) if entry.endswith("K") else int(entry)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"{part.strip()!r} is not a positive token count")
        vals.append(n)
    return vals


def parse_depths(text: str) -> list[float]:
    """"0.1,0.5" -> [0.1, 0.5]; ValueError unless every entry is a number in [0, 1]."""
    vals = []
    for part in text.split(","):
        try:
            d = float(part)
        except ValueError:
            d = float("nan")
        if not 0 <= d <= 1:
            raise ValueError(f"{part.strip()!r} is not a depth in [0, 1]")
        vals.append(d)
    return vals


@app.command()
def needle(
    model: str = typer.Option(..., help="smollm2 | gemma3 | a .gguf file | an HF checkpoint directory"),
    lengths: str = typer.Option("1K,2K,4K,8K", help="context lengths in tokens (K = 1024)"),
    depths: str = typer.Option("0.1,0.5,0.9", help="needle depths in [0, 1]"),
    kv: str = typer.Option("bf16,kivi2,oscar", help=f"comma-separated schemes from: {', '.join(SCHEMES)}"),
    rotations: Path | None = typer.Option(None, help="calibration artifact (required by oscar* schemes)"),
    trials: int = typer.Option(4, min=1, help="passkeys per (length, depth), decoded as one batch"),
    json_out: Path | None = typer.Option(None, "--json", help="write the records here"),
):
    """Passkey retrieval accuracy per context length and depth, through the decode loop."""
    names = cli.schemes(kv, SCHEMES)
    try:
        token_counts = parse_lengths(lengths)
    except ValueError as e:
        cli.fail(f"--lengths {lengths!r}: {e}; expected comma-separated token counts such as 1K,2K,4096")
    try:
        depth_values = parse_depths(depths)
    except ValueError as e:
        cli.fail(f"--depths {depths!r}: {e}")
    cli.check_writable(json_out, "--json")
    cfg = cli.model_config(model)
    for n in token_counts:
        cli.check_context(cfg, n + NEW_TOKENS, f"--lengths {n} + {NEW_TOKENS} generated tokens")
    served = None
    if rotations:
        try:
            served = load_calibration(rotations, cfg)
        except ValueError as e:
            cli.fail(f"--rotations {rotations}: {e}")
    try:
        policies = {name: scheme_policy(name, served) for name in names}
    except ValueError as e:
        cli.fail(f"--kv {kv}: {e}")
    decoder, tokenizer = cli.load_model(model)
    if tokenizer is None:
        cli.fail(f"--model {model}: no tokenizer found")
    for n in token_counts:
        try:
            needle_prompt(tokenizer, n, 0.5, 10000)
        except ValueError as e:
            cli.fail(f"--lengths {n}: {e}")
    results = []
    for name, policy in policies.items():
        results += run(decoder, tokenizer, policy, name, token_counts, depth_values, trials)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    table = Table(title=f"oscar needle {model}: {trials} passkeys per cell; {device}, jax {jax.__version__}")
    for col in ("kv", "length", "depth", "accuracy", "bits/elem"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(r.kv, str(r.length), f"{r.depth:.2f}", f"{r.accuracy:.2f}", f"{r.bpe:.2f}")
    console.print(table)
    if json_out:
        records = [{"model": model, **dataclasses.asdict(r)} for r in results]
        results_io.write(json_out, results_io.record(records, "oscar " + " ".join(sys.argv[1:])))
