"""Teacher-forced evaluation THROUGH the real cache, against full precision in lockstep.

Each context window starts with a prefill of its first `chunk` tokens, then
`extend` chunks (append, then attend; docs/method.md §4), so every later token
attends to quantised history exactly as serving would. A float32 dense cache
runs the same chunks in lockstep; per chunk, and never more than one chunk's
logits at a time, each scheme adds up its negative log-likelihood of the next
token, its KL divergence from the full-precision next-token distribution and
its top-1 agreement with it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import typer
from rich.progress import Progress
from rich.table import Table

from oscar_jax import artifact
from oscar_jax import cache as oc
from oscar_jax import rotation
from oscar_jax.config import QuantConfig
from oscar_jax.models import cli, corpus, kv_policy
from oscar_jax.models import results as results_io
from oscar_jax.models import generate as gen
from oscar_jax.models.cli import app, console, load_calibration
from oscar_jax.models.decoder import Decoder, forward_logits

FIXED_CLIPS = (0.96, 0.92)  # the reference's (K, V) clip ratios
HELDOUT_TOKENS = 2048  # held aside for the clip fit when `oscar eval` calibrates first
# Scheme -> (needs a calibration?, description); see `scheme_policy`.
SCHEMES = {
    "bf16": (False, "dense bf16 cache"),
    "fp8": (False, "float8 e4m3 K/V, per-head scales from the prompt's amax (vLLM fp8_e4m3), no sink/window"),
    "int8": (False, "per-token INT8, no rotation, OSCAR's sink/window"),
    "int4": (False, "per-token asymmetric INT4, no rotation, OSCAR's sink/window"),
    "naive-int2": (False, "per-token INT2, no rotation, no sink/window"),
    "naive-int2-win": (False, "per-token INT2, no rotation, OSCAR's sink/window"),
    "kivi2": (False, "KIVI-2: keys per-channel/32 tokens, values per-token/32 channels, 128 fp residual"),
    "quarot-int2": (False, "Hadamard rotation, per-token INT2, OSCAR's sink/window"),
    "oscar": (True, "calibrated rotations, fitted clips"),
    "oscar-lloyd": (True, "calibrated rotations, fitted clips, Lloyd-Max codebook"),
    "oscar-fixedclip": (True, "calibrated rotations, the reference's fixed clips 0.96/0.92"),
    "oscar-hadamard": (True, "Hadamard rotation with the calibration's fitted clips"),
    "oscar-norot": (True, "no rotation, the calibration's fitted clips"),
}


def _quant_name(md) -> str:
    """The artifact's quantiser: 'G=64', or per layer 'per layer: 2-bit G=64 x20, 4-bit G=64 x10'."""
    if md.layer_quant is None:
        return f"G={md.group_size}"
    counts = {}
    for q in md.layer_quants():
        name = f"{q.bits}-bit G={q.group_size or md.head_dim}"
        counts[name] = counts.get(name, 0) + 1
    return "per layer: " + ", ".join(f"{n} x{c}" for n, c in counts.items())


def scheme_policy(name: str, served: kv_policy.QuantPolicy | None = None, implementation: str = "auto"):
    """The KV policy of an evaluation scheme. `served`: the calibrated OSCAR policy
    (`kv_policy.oscar_policy` with the artifact's rotations, clips, quantiser and
    sink/window); the `oscar*` schemes are it and its ablations."""
    if name not in SCHEMES:
        raise ValueError(f"kv scheme {name!r}: expected one of {tuple(SCHEMES)}")
    if SCHEMES[name][0] and served is None:
        raise ValueError(f"kv scheme {name!r} needs calibrated rotations (--rotations DIR, or let eval calibrate)")
    int2 = QuantConfig(bits=2)
    quant = functools.partial(kv_policy.QuantPolicy, implementation=implementation)
    if name in ("bf16", "fp8"):
        return kv_policy.make_policy(name)
    if name in ("int8", "int4"):
        return quant(name, QuantConfig(bits=int(name[3])), 64, 256)
    if name == "naive-int2":
        return quant(name, int2, 0, None)
    if name == "naive-int2-win":
        return quant(name, int2, 64, 256)
    if name == "kivi2":
        return kv_policy.KiviPolicy()
    if name == "quarot-int2":
        return quant(name, int2, 64, 256, "hadamard")
    params = served.layer_params
    if name == "oscar-fixedclip":
        params = dataclasses.replace(params, clip_k=jnp.full_like(params.clip_k, FIXED_CLIPS[0]),
                                     clip_v=jnp.full_like(params.clip_v, FIXED_CLIPS[1]))
    elif name in ("oscar-hadamard", "oscar-norot"):
        d = params.rot_k.shape[-1]
        rot = rotation.hadamard(d) if name == "oscar-hadamard" else rotation.identity(d)
        params = oc.LayerParams.create(rot, rot, params.clip_k, params.clip_v,
                                       num_layers=params.rot_k.shape[0], kv_heads=params.rot_k.shape[1],
                                       k_shift=params.k_shift)
    if name == "oscar-lloyd" and served.layer_quant is not None:
        raise ValueError("kv scheme 'oscar-lloyd': the artifact has a quantiser per layer (a bit budget); "
                         "the Lloyd-Max codebook is for a uniform 2-bit cache")
    codebook = "lloyd_max" if name == "oscar-lloyd" else served.quant.codebook
    return dataclasses.replace(served, name=name, quant=dataclasses.replace(served.quant, codebook=codebook),
                               layer_params=params, implementation=implementation)


@dataclasses.dataclass
class Tally:
    """Running float64 sums of one scheme over evaluated tokens."""

    nll: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    tokens: int = 0

    def add(self, sums: tuple[jax.Array, ...], count: int) -> None:
        nll, kl, agree = (float(x) for x in sums)
        self.nll += nll
        self.kl += kl
        self.agree += agree
        self.tokens += count


@jax.jit
def chunk_sums(ref_logits: jax.Array, logits: jax.Array, targets: jax.Array, mask: jax.Array):
    """One chunk's sums. ref_logits, logits float32 [B, C, V]; targets int32 [B, C];
    mask bool [B, C] -> (NLL of targets, KL(ref || scheme), top-1 agreement), each summed."""
    ref_lp = jax.nn.log_softmax(ref_logits.astype(jnp.float32), axis=-1)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
    kl = jnp.sum(jnp.exp(ref_lp) * (ref_lp - lp), axis=-1)
    agree = jnp.argmax(lp, axis=-1) == jnp.argmax(ref_lp, axis=-1)
    m = mask.astype(jnp.float32)
    return jnp.sum(nll * m), jnp.sum(kl * m), jnp.sum(agree * m)


@dataclasses.dataclass(frozen=True)
class SchemeResult:
    """One row of the evaluation: perplexity, mean KL from full precision, top-1
    agreement with it, bits/element of the cache at the windows' end, tokens, seconds."""

    kv: str
    ppl: float
    kl: float
    top1: float
    bpe: float
    tokens: int
    seconds: float


def windows(token_ids: np.ndarray, context: int, max_tokens: int | None = None) -> np.ndarray:
    """int [N] -> int32 [W, context] consecutive windows (enough to hold max_tokens, tail dropped)."""
    n = len(token_ids) // context
    if max_tokens is not None:
        n = min(n, -(-max_tokens // context))
    if n == 0:
        raise ValueError(f"{len(token_ids)} tokens are fewer than one --context={context} window")
    return np.asarray(token_ids[: n * context], np.int32).reshape(n, context)


def evaluate(model: Decoder, rows: np.ndarray, policies: dict[str, object], *, chunk: int,
             batch: int = 1, progress: Callable[[int], None] | None = None) -> list[SchemeResult]:
    """Evaluate each policy on windows `rows` int32 [W, context] in batches of `batch`.

    Token t >= chunk of every window is predicted through the cache; the first
    chunk is the prefill. progress(n) is called with the tokens evaluated per chunk.
    """
    n_rows, context = rows.shape
    if chunk < 1 or chunk >= context:
        raise ValueError(f"chunk={chunk}: expected 1 <= chunk < context={context}")
    if n_rows % batch:
        raise ValueError(f"{n_rows} windows are not a multiple of batch={batch}")
    reference = kv_policy.DensePolicy("float32")
    tallies = {name: Tally() for name in policies}
    seconds = dict.fromkeys(policies, 0.0)
    bpe = {name: [] for name in policies}
    for r in range(0, n_rows, batch):
        tokens = rows[r: r + batch]
        states = {name: gen.init_state(model, p, batch, context, chunk) for name, p in policies.items()}
        ref_state = gen.init_state(model, reference, batch, context, chunk)
        prompt, lengths = tokens[:, :chunk], np.full((batch,), chunk, np.int32)
        ref_logits, ref_state = gen.prefill(model, ref_state, prompt, lengths)
        first_target, first_mask = tokens[:, chunk:chunk + 1], np.ones((batch, 1), bool)
        for name, p in policies.items():
            t0 = time.perf_counter()
            logits, states[name] = gen.prefill(model, states[name], prompt, lengths)
            tallies[name].add(chunk_sums(ref_logits[:, None], logits[:, None], first_target, first_mask),
                              batch)
            seconds[name] += time.perf_counter() - t0
        for start in range(chunk, context, chunk):
            x = tokens[:, start: start + chunk]
            targets = np.zeros_like(x)
            nxt = tokens[:, start + 1: start + 1 + chunk]
            targets[:, : nxt.shape[1]] = nxt
            mask = np.zeros(x.shape, bool)
            mask[:, : nxt.shape[1]] = True
            ref_logits, ref_state = gen.extend(model, ref_state, x)
            for name in policies:
                t0 = time.perf_counter()
                logits, states[name] = gen.extend(model, states[name], x)
                tallies[name].add(chunk_sums(ref_logits, logits, targets, mask), int(mask.sum()))
                seconds[name] += time.perf_counter() - t0
            if progress is not None:
                progress(int(mask.sum()))
        for name in policies:
            bpe[name].append(kv_policy.bits_per_element(states[name]))
    return [SchemeResult(kv=name, ppl=float(np.exp(t.nll / t.tokens)), kl=t.kl / t.tokens,
                         top1=t.agree / t.tokens, bpe=float(np.mean(bpe[name])), tokens=t.tokens,
                         seconds=seconds[name])
            for name, t in tallies.items()]


def forward_perplexity(model: Decoder, rows: np.ndarray, chunk: int, kv_dtype=None) -> float:
    """Perplexity of the plain full forward (no cache) over the tokens `evaluate` predicts.
    kv_dtype: K/V rounded to it as a dense cache of that dtype stores them, seen so by every
    query after the `chunk`-token prefill (which attends in full precision); None keeps them."""
    nll, count = 0.0, 0
    forward = jax.jit(functools.partial(forward_logits, kv_dtype=kv_dtype, exact_prefix=chunk))
    for row in rows:
        logits = forward(model, jnp.asarray(row[None]))[0, chunk - 1: -1]
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll -= float(jnp.sum(jnp.take_along_axis(lp, jnp.asarray(row[chunk:, None]), axis=-1)))
        count += len(row) - chunk
    return float(np.exp(nll / count))


# ----------------------------------------------------------------------------
# The `oscar eval` command


def _calibrate(model: Decoder, ids: np.ndarray, tokens: int, heldout: int, seq_len: int) -> oc.LayerParams:
    """Published rotations (U·H·P) with clips fitted on held-aside tokens, from `ids`."""
    from oscar_jax import calibrate as cal
    from oscar_jax.models import capture

    run = capture.collect(model, ids[:tokens], ids[tokens: tokens + heldout], seq_len=seq_len,
                              config=cal.CalibConfig(softmax_scale=model.cfg.softmax_scale))
    result = cal.calibrate(run.stats, run.heldout, softmax_scale=model.cfg.softmax_scale)
    return result.layer_params()


def plot(results: list[SchemeResult], baseline_ppl: float, path, title: str) -> None:
    """ΔPPL and KL against bits/element, one point per scheme (log y)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "dppl", "ΔPPL vs bf16"), (axes[1], "kl", "KL from full precision")):
        for r in results:
            if r.kv == "bf16":
                continue
            y = r.ppl - baseline_ppl if key == "dppl" else r.kl
            ax.scatter(r.bpe, max(y, 1e-6))
            ax.annotate(r.kv, (r.bpe, max(y, 1e-6)), fontsize=8, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel("bits / element (K and V, metadata and bf16 segments included)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@app.command("eval")
def eval_command(
    model: str = typer.Option(..., help="smollm2 | gemma3 | a .gguf file | an HF checkpoint directory"),
    text: str = typer.Option("shakespeare", help="a UTF-8 text FILE, 'shakespeare' (its evaluation works) or "
                                                 "'shakespeare-validation' (for choosing between calibrations)"),
    kv: str = typer.Option("bf16,naive-int2-win,kivi2,quarot-int2,oscar",
                           help=f"comma-separated schemes from: {', '.join(SCHEMES)}"),
    rotations: Path | None = typer.Option(None, help="calibration artifact for the oscar* schemes"),
    tokens: int = typer.Option(32768, min=1, help="evaluated tokens (rounded up to whole windows)"),
    context: int = typer.Option(8192, min=2, help="tokens per evaluation window"),
    chunk: int = typer.Option(64, min=1, help="prefill and extend chunk"),
    batch: int = typer.Option(1, min=1, help="windows evaluated together"),
    calibration_tokens: int = typer.Option(8192, min=1, help="when calibrating first (no --rotations)"),
    json_out: Path | None = typer.Option(None, "--json", help="write the records here"),
    plot_out: Path | None = typer.Option(None, "--plot", help="write the ΔPPL/KL vs bits plot here"),
    implementation: str = typer.Option("auto", help="attend() implementation for OSCAR-cache layers"),
):
    """Perplexity, KL and top-1 agreement vs full precision, through the real cache."""
    names = cli.schemes(kv, SCHEMES)
    cli.check_implementation(implementation)
    if chunk >= context:
        cli.fail(f"--chunk {chunk} must be smaller than --context {context}")
    cli.check_writable(json_out, "--json")
    cli.check_writable(plot_out, "--plot")
    cfg = cli.model_config(model)
    cli.check_context(cfg, context, "an evaluation window (--context)")
    calibrated = any(SCHEMES[n][0] for n in names)
    served = None
    if calibrated and rotations:
        try:
            served = load_calibration(rotations, cfg)
            md = artifact.read_metadata(rotations)
        except ValueError as e:
            cli.fail(f"--rotations {rotations}: {e}")
    if text not in ("shakespeare", "shakespeare-validation"):
        file_text = cli.read_text(text)
    decoder, tokenizer = cli.load_model(model)
    if tokenizer is None:
        cli.fail(f"--model {model}: no tokenizer found to encode --text")
    if text in ("shakespeare", "shakespeare-validation"):
        split = "evaluation" if text == "shakespeare" else "validation"
        try:
            eval_text, eval_works = corpus.shakespeare_text(split)
            calib_text, calib_works = corpus.shakespeare_text("calibration")
        except FileNotFoundError as e:
            cli.fail(f"--text {text}: {e}")
        source = {"eval": f"shakespeare {split}: {', '.join(eval_works)}",
                  "calibration": f"shakespeare calibration: {', '.join(calib_works)}"}
        eval_ids = np.asarray(tokenizer.encode(eval_text), np.int32)
        calib_ids = np.asarray(tokenizer.encode(calib_text), np.int32)
        after = ""
    else:  # one file: calibrate on its first tokens, evaluate on the rest
        ids = np.asarray(tokenizer.encode(file_text), np.int32)
        n_calib = calibration_tokens + HELDOUT_TOKENS if calibrated and not rotations else 0
        calib_ids, eval_ids = ids[:n_calib], ids[n_calib:]
        source = {"eval": f"{text} tokens [{n_calib}, end)", "calibration": f"{text} tokens [0, {n_calib})"}
        after = f" after the first {n_calib} (--calibration-tokens + {HELDOUT_TOKENS}, to calibrate)" if n_calib else ""
    if len(eval_ids) < context:
        cli.fail(f"--text {text}: {len(eval_ids)} tokens to evaluate{after}, fewer than one --context {context} window")
    rows = windows(eval_ids, context, tokens)
    if batch > len(rows):
        cli.fail(f"--batch {batch} is more than the {len(rows)} window(s) of --context {context} "
                 f"that --tokens {tokens} and --text {text} give")
    rows = rows[: len(rows) // batch * batch]
    seq_len = min(1024, context)
    if calibrated and not rotations and (calibration_tokens < seq_len
                                         or len(calib_ids) < calibration_tokens + seq_len):
        cli.fail(f"--calibration-tokens {calibration_tokens}: calibrating first (no --rotations) needs at least "
                 f"one window of {seq_len} tokens and {seq_len} held-aside tokens after them; the calibration "
                 f"text has {len(calib_ids)}")
    if calibrated:
        if rotations:
            source["calibration"] = (f"artifact {rotations}: {md.tokens} tokens (corpus hash {md.corpus_hash[:12]}, "
                                     f"{md.rotation_k}/{md.rotation_v}, {_quant_name(md)}, sink {md.sink}, "
                                     f"{'centered keys, ' if md.center_keys else ''}"
                                     f"window {md.window}) of "
                                     + source["calibration"])
        else:
            console.print(f"no --rotations: calibrating on {calibration_tokens} tokens of the "
                          f"calibration text first (disjoint from the evaluation text)")
            served = kv_policy.oscar_policy(
                _calibrate(decoder, calib_ids, calibration_tokens, HELDOUT_TOKENS, seq_len))
    policies = {n: scheme_policy(n, served, implementation) for n in names}
    with Progress(console=console) as bar:
        task = bar.add_task(f"eval {len(rows)}x{context} tokens, {len(names)} schemes",
                            total=len(rows) * (context - chunk))
        results = evaluate(decoder, rows, policies, chunk=chunk, batch=batch,
                           progress=lambda n: bar.advance(task, n))
    base = next((r.ppl for r in results if r.kv == "bf16"), None)
    device = f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
    table = Table(title=f"oscar eval {model}: {results[0].tokens} tokens/scheme, context {context}, "
                        f"chunk {chunk}; {device}, jax {jax.__version__}")
    for col in ("kv", "bits/elem", "PPL", "ΔPPL", "KL", "top-1", "s"):
        table.add_column(col, justify="right")
    for r in results:
        dppl = "" if base is None else f"{r.ppl - base:+.4f}"
        table.add_row(r.kv, f"{r.bpe:.2f}", f"{r.ppl:.4f}", dppl, f"{r.kl:.5f}", f"{r.top1:.4f}",
                      f"{r.seconds:.0f}")
    console.print(table)
    if json_out:
        run = {"model": model, "context": context, "chunk": chunk, "windows": len(rows), "eval_text": source["eval"]}
        records = [{**dataclasses.asdict(r), **run,
                    **({"calibration": source["calibration"]} if SCHEMES[r.kv][0] else {})} for r in results]
        results_io.write(json_out, results_io.record(records, "oscar " + " ".join(sys.argv[1:])))
    if plot_out and base is not None:
        plot(results, base, plot_out, f"{model}, {source['eval'][:60]}..., context {context}, "
                                      f"{device}, jax {jax.__version__}")

