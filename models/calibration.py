"""`oscar calibrate`: a real decoder's activations (`capture`) -> `oscar_jax.calibrate` -> artifact.

The model runs full-precision forwards over consecutive windows of calibration
text; the post-RoPE (post qk-norm) q, k, v of the full-attention layers (the ones
the OSCAR cache serves) stream into the accumulator. The tokens after the
calibration ones are held aside for the clip fit and the variant comparison.
Learned rotations (`oscar_jax.learn`) take a second stream of the same windows,
captured again batch by batch; bit budgets (`oscar_jax.budget`) are measured on
windows of the serving context after the held-aside ones.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import typer

from oscar_jax import artifact, budget
from oscar_jax import calibrate as cal
from oscar_jax import learn
from oscar_jax.config import QuantConfig
from oscar_jax.models import cli, sensitivity
from oscar_jax.models import results as results_io
from oscar_jax.models.capture import (calibration_text, capture_batches, capture_windows, collect, compare_variants,
                                     eigen_spread, forward, full_layers, split_variant, windows)
from oscar_jax.models.cli import app, console


def _measured_budget(path: Path, settings: dict) -> dict:
    """The budget row of an `oscar calibrate --json` record whose settings equal `settings`
    (a key the row lacks is not compared; the KL settings only when it weighed by KL), else
    ValueError naming the first that differs."""
    rows = [r for r in results_io.read(path)["rows"] if r.get("variant") == "budget"]
    if len(rows) != 1:
        raise ValueError(f"expected one budget row, found {len(rows)}")
    row = rows[0]
    missing = [k for k in ("layer_errors", "layer_weights") if k not in row]
    if missing:
        raise ValueError(f"its budget row lacks {missing} (written by an older oscar calibrate)")
    for key, want in settings.items():
        if key.startswith("kl_") and row.get("weights") != "kl":
            continue
        if key in row and row[key] != want:
            raise ValueError(f"its {key} is {row[key]!r}, this run's {want!r}: measured for other settings")
    return row


def _check_pair(rot_k: str, rot_v: str) -> None:
    """ValueError unless both names parse and learned K and V share the per-head setting."""
    learned = [s for s in map(cal.RotationSpec.parse, (rot_k, rot_v)) if s.kind == "learned"]
    if len({s.per_head for s in learned}) > 1:
        raise ValueError(f"learned K {rot_k!r} and V {rot_v!r} must both be per head (learned/head) or both per layer")


def _learn_options(rotation_k: str, rotation_v: str, seq_len: int, sink: int, window: int) -> None:
    """`cli.fail` on learned-rotation settings that cannot train: learned K and V of different
    per-head settings, or windows with no quantised token (--seq-len <= --sink + --window)."""
    try:
        _check_pair(rotation_k, rotation_v)
    except ValueError as e:
        cli.fail(f"--rotation-k {rotation_k!r} --rotation-v {rotation_v!r}: {e}")
    learned = any(cal.RotationSpec.parse(r).kind == "learned" for r in (rotation_k, rotation_v))
    if learned and seq_len <= sink + window:
        cli.fail(f"--seq-len {seq_len}: learned rotations train on windows longer than --sink + --window = "
                 f"{sink + window} (their quantised tokens)")


@app.command()
def calibrate(
    model: str = typer.Option(..., help="smollm2 | gemma3 | a .gguf file | an HF checkpoint directory"),
    text: str = typer.Option("shakespeare", help="a UTF-8 text FILE, or 'shakespeare' (its calibration split)"),
    tokens: int = typer.Option(32768, min=1, help="calibration tokens"),
    heldout_tokens: int = typer.Option(2048, min=1, help="held-aside tokens (after the calibration ones)"),
    seq_len: int = typer.Option(1024, min=8, help="tokens per forward window"),
    out: Path = typer.Option(..., help="artifact directory to create"),
    rotation_k: str = typer.Option("uhp", help=f"key rotation: KIND or KIND/head, KIND in {cal.ROTATION_KINDS}"),
    rotation_v: str = typer.Option("uhp", help="value rotation (same names)"),
    value_weighting: str = typer.Option("published", help=f"one of {cal.VALUE_WEIGHTINGS}"),
    clips: str = typer.Option("fit", help="fit (grid clip-min..1.00 on held-aside tokens) | fixed (0.96/0.92)"),
    clip_min: float = typer.Option(0.70, min=0.05, max=1.0, help="lowest clip ratio of the fit grid (step 0.01)"),
    group_size: int | None = typer.Option(None, help="quantiser group size G (default: head dim)"),
    sink: int = typer.Option(64, min=0, help="bf16 sink tokens the artifact is served with"),
    window: int = typer.Option(256, min=1, help="bf16 recent-window tokens the artifact is served with"),
    center_keys: bool = typer.Option(False, help="remove the calibration keys' mean before quantising "
                                                 "(softmax-exact; not in the published recipe)"),
    sample_tokens: int = typer.Option(4096, min=1, help="bounded sample for the published value weights"),
    learn_init: str = typer.Option("uhp", help=f"learned rotations start from this variant, one of {learn.INIT_KINDS}"),
    learn_epochs: int = typer.Option(1, help="learned rotations: passes over the calibration windows"),
    learn_steps: int = typer.Option(4, help="learned rotations: Adam steps per batch of windows"),
    learn_batch: int = typer.Option(1, help="learned rotations: windows per batch"),
    learn_tokens: int | None = typer.Option(None, help="learned rotations: train on the first N calibration "
                                                       "tokens (default: all --tokens)"),
    learn_queries: int = typer.Option(128, help="learned rotations: queries sampled per window and step"),
    learn_rate: float = typer.Option(1e-3, help="learned rotations: Adam learning rate"),
    target_bpe: float | None = typer.Option(None, help="a bit budget: each layer's quantiser chosen among "
                                                       "--budget-candidates (least summed held-aside served "
                                                       "error) within these bits/element at --budget-context"),
    budget_candidates: str = typer.Option("", help="BITS[:G],... the --target-bpe candidates (default: 2 and 4 "
                                                   "bits at --group-size and at half of it)"),
    budget_context: int = typer.Option(8192, min=1, help="--target-bpe: the sequence length the bits are counted "
                                                         "and the errors measured at"),
    budget_segments: str = typer.Option("", help="--target-bpe: SINK+WINDOW,... the bf16 segments to choose among "
                                                 "(default: --sink + --window)"),
    budget_windows: int = typer.Option(2, min=1, help="--target-bpe: held-aside sequences of --budget-context "
                                                      "tokens the errors are measured on (after --heldout-tokens)"),
    budget_chunk: int = typer.Option(1, min=1, help="--target-bpe: the serving chunk the errors assume (1: token "
                                                    "by token; an evaluation's --chunk)"),
    budget_weights: str = typer.Option("none", help="--target-bpe: none (sum the layers' errors) | kl (weigh each "
                                                    "layer's errors by the output KL per unit of error when only "
                                                    "it is served quantised: sensitivity.layer_kl)"),
    budget_kl_context: int = typer.Option(2048, min=2, help="--budget-weights kl: tokens per held-aside sequence"),
    budget_kl_windows: int = typer.Option(1, min=1, help="--budget-weights kl: held-aside sequences (after the "
                                                         "--budget-windows ones)"),
    budget_measured: Path | None = typer.Option(None, help="--target-bpe: take the per-layer errors and weights "
                                                           "from the budget row of an earlier --json record of "
                                                           "the same settings (another target) instead of "
                                                           "measuring them again"),
    budget_relearn: bool = typer.Option(False, help="--target-bpe with learned rotations: train them again, from "
                                                    "the first ones, for each layer's chosen quantiser and the "
                                                    "chosen sink + window, then refit the clips (the errors shown "
                                                    "and recorded stay those the choice was made on)"),
    compare: str = typer.Option("", help="comma-separated variants whose held-aside errors to print: "
                                              "a rotation name (K and V) or K:V"),
    time_forward: bool = typer.Option(False, help="also time one plain forward over the same tokens"),
    json_out: Path | None = typer.Option(None, "--json", help="write the timings and --compare errors here"),
):
    """Calibrate OSCAR rotations and clip ratios for a model and write the artifact.
    Every argument and the output path are checked before the first forward."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    cli.check_writable(out, "--out", directory=True)
    cli.check_writable(json_out, "--json")
    if clips not in ("fit", "fixed"):
        cli.fail(f"--clips {clips!r}: expected 'fit' or 'fixed'")
    names = tuple(n.strip() for n in compare.split(",")) if compare else ()
    learn_args = {"--learn-init": ("init", learn_init), "--learn-epochs": ("epochs", learn_epochs),
                  "--learn-steps": ("steps_per_batch", learn_steps), "--learn-queries": ("queries", learn_queries),
                  "--learn-rate": ("learning_rate", learn_rate)}
    for option, value, check in (
            ("--value-weighting", value_weighting, lambda: cal.CalibConfig(value_weighting, sample_tokens)),
            ("--rotation-k", rotation_k, lambda: cal.RotationSpec.parse(rotation_k)),
            ("--rotation-v", rotation_v, lambda: cal.RotationSpec.parse(rotation_v)),
            ("--compare", compare, lambda: [_check_pair(*split_variant(n)) for n in names]),
            ("--group-size", group_size, lambda: QuantConfig(group_size=group_size)),
            *((option, value, lambda f=field, x=value: learn.LearnConfig(**{f: x}))
              for option, (field, value) in learn_args.items())):
        try:
            check()
        except ValueError as e:
            cli.fail(f"{option} {value!r}: {e}")
    if learn_batch < 1:
        cli.fail(f"--learn-batch {learn_batch}: expected an int >= 1")
    learn_cfg = learn.LearnConfig(**dict(learn_args.values()))
    _learn_options(rotation_k, rotation_v, seq_len, sink, window)
    quant_cfg = QuantConfig(group_size=group_size)
    calib_cfg = cal.CalibConfig(value_weighting, sample_tokens)
    cfg = cli.model_config(model)
    if cfg.head_dim % (group_size or cfg.head_dim):
        cli.fail(f"--group-size {group_size} does not divide the model's head dim {cfg.head_dim}")
    if not full_layers(cfg):
        cli.fail(f"--model {model} has no full-attention layer to calibrate")
    cli.check_context(cfg, seq_len, "a forward window (--seq-len)")
    if tokens < seq_len:
        cli.fail(f"--tokens {tokens} is less than one --seq-len {seq_len} window")
    learn_tokens = tokens if learn_tokens is None else learn_tokens
    if not seq_len <= learn_tokens <= tokens:
        cli.fail(f"--learn-tokens {learn_tokens}: expected one --seq-len {seq_len} window to --tokens {tokens}")
    candidates, segments, context_tokens = (), ((sink, window),), 0
    if target_bpe is not None:
        if not (target_bpe > 0 and math.isfinite(target_bpe)):
            cli.fail(f"--target-bpe {target_bpe}: expected a finite number of bits/element > 0")
        g = group_size or cfg.head_dim
        listed = budget_candidates or ",".join(f"{b}:{x}" for b in (2, 4) for x in dict.fromkeys((g, max(g // 2, 1))))
        try:
            candidates = budget.parse_candidates(listed, cfg.head_dim)
        except ValueError as e:
            cli.fail(f"--budget-candidates {listed!r}: {e}")
        if budget_segments:
            try:
                segments = budget.parse_segments(budget_segments)
            except ValueError as e:
                cli.fail(f"--budget-segments {budget_segments!r}: {e}")
        for s, w in segments:
            if budget_context <= s + w or budget_chunk > w:
                cli.fail(f"--budget-context {budget_context}, --budget-chunk {budget_chunk}: expected more tokens "
                         f"than sink + window = {s + w} and a chunk of at most the window {w}")
        bits = np.stack([budget.candidate_bits(candidates, head_dim=cfg.head_dim, sink=s, window=w,
                                               context=budget_context) for s, w in segments])
        if bits.min() > target_bpe:
            cli.fail(f"--target-bpe {target_bpe}: the cheapest candidate costs {bits.min():.3f} bits/element at "
                     f"--budget-context {budget_context} with the sink + window "
                     f"{'+'.join(map(str, segments[int(bits.min(axis=1).argmin())]))}")
        cli.check_context(cfg, budget_context, "a held-aside sequence (--budget-context)")
        context_tokens = budget_windows * budget_context
        if budget_weights not in ("none", "kl"):
            cli.fail(f"--budget-weights {budget_weights!r}: expected 'none' or 'kl'")
        if budget_weights == "kl":
            s, w = segments[0]
            if budget_kl_context <= s + w:
                cli.fail(f"--budget-kl-context {budget_kl_context}: expected more tokens than the first segment's "
                         f"sink + window = {s + w}")
            cli.check_context(cfg, budget_kl_context, "a held-aside sequence (--budget-kl-context)")
            context_tokens += budget_kl_windows * budget_kl_context
        if budget_measured is not None:
            try:
                measured = _measured_budget(budget_measured, {
                    "model": model, "tokens": tokens // seq_len * seq_len, "seq_len": seq_len,
                    "center_keys": center_keys, "context": budget_context, "chunk": budget_chunk,
                    "heldout_sequences": budget_windows, "candidates": [dataclasses.asdict(q) for q in candidates],
                    "segments": [list(x) for x in segments], "weights": budget_weights,
                    "heldout_tokens": heldout_tokens, "rotation_k": rotation_k, "rotation_v": rotation_v,
                    "clips": clips, "clip_min": clip_min,
                    "kl_context": budget_kl_context, "kl_sequences": budget_kl_windows})
            except (OSError, ValueError, KeyError) as e:
                cli.fail(f"--budget-measured {budget_measured}: {e}")
    if budget_relearn and (target_bpe is None or not any(cal.RotationSpec.parse(r).kind == "learned"
                                                         for r in (rotation_k, rotation_v))):
        cli.fail("--budget-relearn: expected --target-bpe and a learned --rotation-k or --rotation-v")
    if budget_relearn and max(s + w for s, w in segments) >= seq_len:
        cli.fail(f"--budget-relearn: every --budget-segments sink + window must be below --seq-len {seq_len} "
                 f"(learning trains on windows of --seq-len tokens)")
    held_windows = 2 if compare else 1
    if heldout_tokens < held_windows * seq_len:
        cli.fail(f"--heldout-tokens {heldout_tokens} must hold at least {held_windows} --seq-len {seq_len} "
                 f"window(s){' (--compare fits on one, measures on another)' if compare else ''}")
    if compare and seq_len <= sink + window:
        cli.fail(f"--seq-len {seq_len}: --compare measures the served error on windows longer than "
                 f"--sink + --window = {sink + window}")
    try:
        source = calibration_text(text)
    except (ValueError, OSError) as e:
        cli.fail(f"--text {text}: {e}")
    decoder, tokenizer = cli.load_model(model)
    if tokenizer is None:
        cli.fail(f"--model {model}: no tokenizer found to encode --text")
    calib_cfg = dataclasses.replace(calib_cfg, softmax_scale=decoder.cfg.softmax_scale)
    needed = tokens + heldout_tokens + context_tokens
    ids = np.asarray(tokenizer.encode(source)[:needed], np.int32)
    if len(ids) < needed:
        extra = " + --budget-windows x --budget-context" if context_tokens else ""
        cli.fail(f"--text {text} has {len(ids)} tokens; need --tokens + --heldout-tokens{extra} = {needed}")
    with Progress(console=console) as bar:
        task = bar.add_task("calibration forwards", total=tokens)
        run = collect(decoder, ids[:tokens], ids[tokens: tokens + heldout_tokens], seq_len=seq_len,
                      config=calib_cfg, progress=lambda n: bar.advance(task, n))
    grid = tuple(np.round(np.arange(clip_min, 1.0 + 1e-9, 0.01), 2))
    learned_cache: dict[tuple[str, str], tuple[cal.Rotation, cal.Rotation]] = {}
    learn_seconds = 0.0

    def learned(rot_k: str, rot_v: str, start=None, layer_quant=None, segment=None) -> tuple[cal.Rotation, ...]:
        """Train the learned ones of (rot_k, rot_v) with a progress bar: once from --learn-init
        (cached), or again from `start` for per-layer quantisers and a segment (a budget's)."""
        nonlocal learn_seconds
        if start is None and (rot_k, rot_v) in learned_cache:
            return learned_cache[rot_k, rot_v]
        t0 = time.perf_counter()
        batches = capture_batches(decoder, ids[:learn_tokens], seq_len=seq_len, batch=learn_batch)
        n_batches = -(-(learn_tokens // seq_len) // learn_batch)
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("served output error {task.fields[loss]}"), TimeElapsedColumn())
        s, w = segment or (sink, window)
        origin = learn_cfg.init if start is None else f"the budget: its quantisers, {s} + {w}"
        with Progress(*columns, console=console) as bar:
            task = bar.add_task(f"learning K {rot_k}, V {rot_v} from {origin}", total=learn_cfg.epochs * n_batches,
                                loss="-")
            rotations = learn.learn_rotations(
                run.stats, batches, rotation_k=rot_k, rotation_v=rot_v, quant_cfg=quant_cfg,
                sink=s, window=w, config=learn_cfg, center_keys=center_keys, grid=grid,
                softmax_scale=decoder.cfg.softmax_scale, start=start, layer_quant=layer_quant,
                progress=lambda losses: bar.update(task, advance=1, loss=f"{losses.mean():.4f}"))
        learn_seconds += time.perf_counter() - t0
        if start is None:
            learned_cache[rot_k, rot_v] = rotations
        return rotations

    is_learned = lambda name: cal.RotationSpec.parse(name).kind == "learned"
    rotations = learned(rotation_k, rotation_v) if is_learned(rotation_k) or is_learned(rotation_v) else (
        rotation_k, rotation_v)
    t0 = time.perf_counter()
    scale = decoder.cfg.softmax_scale
    if target_bpe is None:
        result = cal.calibrate(run.stats, run.heldout, rotation_k=rotations[0], rotation_v=rotations[1],
                               quant_cfg=quant_cfg, clips=clips, grid=grid, softmax_scale=scale,
                               center_keys=center_keys)
    elif budget_measured is not None:
        calibrations = [cal.calibrate(run.stats, run.heldout, rotation_k=rotations[0], rotation_v=rotations[1],
                                      quant_cfg=q, clips=clips, grid=grid, softmax_scale=scale,
                                      center_keys=center_keys) for q in candidates]
        layer_kl = None if measured.get("layer_kl") is None else (np.asarray(measured["layer_kl"]),
                                                                   np.asarray(measured["layer_kl_error"]))
        choice = budget.choose(calibrations, segments, measured["layer_errors"], bits, measured["layer_weights"],
                               target_bpe)
        result, (sink, window) = choice.calibration, choice.segment
        budget_errors, picked = choice.errors[choice.chosen], choice.picked
    else:
        after = tokens + heldout_tokens + budget_windows * budget_context
        context_held = capture_windows(decoder, ids[tokens + heldout_tokens: after], budget_context)
        layer_kl = None

        def weigh(first: cal.Calibration) -> np.ndarray:
            """Each layer's KL per unit of error, the first candidate served with the first segment."""
            nonlocal layer_kl
            kl_ids = windows(ids[after:], budget_kl_context)
            with Progress(console=console) as bar:
                task = bar.add_task("output KL per layer", total=len(kl_ids) * len(run.layers))
                layer_kl = sensitivity.layer_kl(decoder, kl_ids, first, sink=segments[0][0], window=segments[0][1],
                                                chunk=min(budget_chunk, segments[0][1]),
                                                progress=lambda: bar.advance(task))
            return budget.output_weights(*layer_kl)

        choice = budget.calibrate_within(run.stats, run.heldout, context_held, *rotations, candidates, target_bpe,
                                         segments, clips, grid, scale, chunk=budget_chunk, center_keys=center_keys,
                                         weigh=weigh if budget_weights == "kl" else None)
        del context_held
        result, (sink, window) = choice.calibration, choice.segment
        budget_errors, picked = choice.errors[choice.chosen], choice.picked
    fit_s = time.perf_counter() - t0
    if budget_relearn:  # train again for the chosen quantisers and segment, then refit each quantiser's clips
        again = learned(rotation_k, rotation_v, start=(result.rot_k, result.rot_v), layer_quant=result.layer_quant,
                        segment=(sink, window))
        t0 = time.perf_counter()
        used = list(dict.fromkeys(picked.tolist()))
        refit = budget.select([cal.calibrate(run.stats, run.heldout, rotation_k=again[0], rotation_v=again[1],
                                             quant_cfg=candidates[j], clips=clips, grid=grid, softmax_scale=scale,
                                             center_keys=center_keys) for j in used],
                              np.array([used.index(j) for j in picked.tolist()]))
        result = dataclasses.replace(refit, quant=result.quant)
        fit_s += time.perf_counter() - t0
    try:
        meta = artifact.save(out, result, model_name=str(model), config_hash=artifact.fingerprint(decoder.cfg),
                             corpus_hash=artifact.fingerprint(ids), layers=run.layers,
                             sink=sink, window=window)
    except ValueError as e:
        cli.fail(f"--out {out}: {e}")
    spread_k, spread_v = eigen_spread(run.stats)
    table = Table(title=f"oscar calibrate {model}: {run.stats.tokens} tokens, {meta.rotation_k}/"
                        f"{meta.rotation_v}, {value_weighting}, clips {clips}")
    quant_name = lambda q: f"{q.bits}-bit G={q.group_size or cfg.head_dim}"
    budget_cols = () if target_bpe is None else ("quantiser", *(f"error {quant_name(q)}" for q in candidates))
    for col in ("layer", "λmax/λmed C_K", "λmax/λmed C_V", "clip K", "clip V", *budget_cols):
        table.add_column(col, justify="right")
    for i, layer in enumerate(run.layers):
        budget_cells = () if target_bpe is None else (
            quant_name(result.layer_quant[i]), *(f"{e:.4f}" for e in budget_errors[i]))
        table.add_row(str(layer), f"{spread_k[i]:.1f}", f"{spread_v[i]:.1f}",
                      f"{result.clip_k[i]:.2f}", f"{result.clip_v[i]:.2f}", *budget_cells)
    console.print(table)
    if target_bpe is not None:
        shown = choice.errors * choice.weights[None, :, None]
        what = "output-KL-weighted " if budget_weights == "kl" else ""
        seg_table = Table(title=f"summed {what}held-aside served error at {budget_context} tokens (chunk "
                                f"{budget_chunk}) and bits/element: the budget within {target_bpe} and each uniform "
                                f"candidate")
        for col in ("sink + window", "budget", *(quant_name(q) for q in candidates)):
            seg_table.add_column(col, justify="right")
        for i, (s, w) in enumerate(segments):
            try:
                _, best = budget.allocate_segments(shown[i: i + 1], choice.bits[i: i + 1], target_bpe)
                spent = f"{shown[i, np.arange(len(best)), best].sum():.4f} at {choice.bits[i, best].mean():.3f}"
            except ValueError:
                spent = "-"
            mark = " (chosen)" if i == choice.chosen else ""
            uniform = (f"{shown[i, :, c].sum():.4f} at {choice.bits[i, c]:.3f}" for c in range(len(candidates)))
            seg_table.add_row(f"{s} + {w}{mark}", spent, *uniform)
        console.print(seg_table)
    at_edge = int(np.sum(result.clip_k <= grid[0]) + np.sum(result.clip_v <= grid[0])) if clips == "fit" else 0
    if at_edge:
        console.print(f"[yellow]{at_edge} of {2 * len(run.layers)} fitted ratios sit at the grid's lowest "
                      f"value {grid[0]}: the fit's optimum may lie below it (--clip-min; a lower floor helps "
                      f"some recipes and hurts others on held-out text: README)[/yellow]")
    learned_note = f", {learn_seconds:.1f} s (learning rotations)" if learn_seconds else ""
    console.print(f"calibration wall time: {run.seconds:.1f} s (forwards + statistics){learned_note}, "
                  f"{fit_s:.1f} s (rotations + clip fit); artifact: {out}")
    setting = {"model": model, "tokens": run.stats.tokens, "seq_len": seq_len, "group_size": meta.group_size,
               "center_keys": center_keys, "sink": sink, "window": window}
    timing = {**setting, "rotation_k": meta.rotation_k, "rotation_v": meta.rotation_v,
              "calibration_forward_s": run.seconds, "learn_s": learn_seconds, "fit_s": fit_s}
    rows = [timing]
    if target_bpe is not None:
        rows.append({**setting, "variant": "budget", "target_bpe": target_bpe, "context": budget_context,
                     "chunk": budget_chunk, "heldout_sequences": budget_windows, "heldout_tokens": heldout_tokens,
                     "rotation_k": rotation_k, "rotation_v": rotation_v, "clips": clips, "clip_min": clip_min,
                     "measured_in": None if budget_measured is None else str(budget_measured),
                     "relearned": budget_relearn,
                     "bpe": float(choice.bits[choice.chosen, picked].mean()),
                     "candidates": [dataclasses.asdict(q) for q in candidates],
                     "segments": [list(x) for x in segments], "candidate_bpe": choice.bits.tolist(),
                     "layer_errors": choice.errors.tolist(), "picked": picked.tolist(),
                     "weights": budget_weights, "layer_weights": choice.weights.tolist(),
                     **({} if layer_kl is None else {
                         "kl_context": budget_kl_context, "kl_sequences": budget_kl_windows,
                         "layer_kl": layer_kl[0].tolist(), "layer_kl_error": layer_kl[1].tolist()})})
    if time_forward:
        calib_rows = windows(ids[:tokens], seq_len)
        jax.block_until_ready(forward(decoder, jnp.asarray(calib_rows[:1])))  # compile
        t0 = time.perf_counter()
        for row in calib_rows:
            jax.block_until_ready(forward(decoder, jnp.asarray(row[None])))
        forward_s = time.perf_counter() - t0
        timing.update(plain_forward_s=forward_s, ratio=(run.seconds + learn_seconds + fit_s) / forward_s)
        console.print(f"plain forward over the same {len(calib_rows) * seq_len} tokens: {forward_s:.1f} s "
                      f"({jax.devices()[0].device_kind}, jax {jax.__version__}); calibration / forward = "
                      f"{(run.seconds + learn_seconds + fit_s) / forward_s:.2f}x")
    if compare:
        errors = compare_variants(run, names, quant_cfg, clips, grid, decoder.cfg.softmax_scale, sink=sink,
                                  window=window, center_keys=center_keys, learned=learned)
        g = quant_cfg.group_size or decoder.cfg.head_dim
        meta_bits = 16 if quant_cfg.scale_dtype == "bfloat16" else 32
        table = Table(title=f"held-aside errors: {quant_cfg.bits + 2 * meta_bits / g:.2f} bits/element in the "
                            f"history (G={g}), clips {clips}{', centered keys' if center_keys else ''}")
        table.add_column("variant")
        table.add_column("rel. logit MSE (K quantised)", justify="right")
        table.add_column("rel. output MSE (V quantised)", justify="right")
        table.add_column(f"rel. output MSE (K, V served: sink {sink}, window {window})", justify="right")
        measured = run.heldout[1].shape[1] - run.heldout[1].shape[1] // 2  # windows (compare_variants)
        for name, errs in errors.items():
            table.add_row(name, *(f"{e.mean():.4f}" for e in errs))
            rows.append({**setting, "variant": name, "heldout_tokens": measured * seq_len,
                         "logit_mse_k": float(errs[0].mean()), "output_mse_v": float(errs[1].mean()),
                         "served_output_mse": float(errs[2].mean())})
        console.print(table)
    if json_out:
        results_io.write(json_out, results_io.record(rows, "oscar " + " ".join(sys.argv[1:])))
