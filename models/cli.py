"""The `oscar` command line (typer).

Other modules add commands to the same app with one line in COMMAND_MODULES:
each such module does `from oscar_jax.models.cli import app` and decorates its
functions with `@app.command()`; `main()` imports them before running.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

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
                                     "oscar_jax.models.needle")


def load_calibration(directory: Path, model_cfg, implementation: str = "auto"):
    """The calibrated OSCAR policy (`kv_policy.QuantPolicy`) of an artifact directory
    (`oscar_jax.artifact`): its rotations and clips for the model's full-attention
    layers, served with the quantiser (group size, codebook) and the bf16 sink/window
    it was calibrated for."""
    from oscar_jax import artifact
    from oscar_jax.config import QuantConfig
    from oscar_jax.models import kv_policy

    params, meta = artifact.load_for_model(directory, model_cfg=model_cfg)
    return kv_policy.oscar_policy(params, quant=QuantConfig(**meta.quant), sink=meta.sink, window=meta.window,
                                  implementation=implementation)


@app.command()
def generate(
    model: str = typer.Option(..., help="smollm2 | gemma3 | a .gguf file | an HF checkpoint directory"),
    prompt: str = typer.Option(..., help="the prompt text"),
    kv: str = typer.Option("oscar", help="KV cache: bf16 | fp32 | fp8 | oscar | quarot | kivi | int2 | int4 | int8"),
    rotations: Path | None = typer.Option(None, help="calibration artifact directory (--kv oscar)"),
    max_new_tokens: int = typer.Option(64, min=1),
    temperature: float = typer.Option(0.0, min=0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0, min=0.0, max=1.0),
    seed: int = typer.Option(0),
    dtype: str = typer.Option("float32", help="weights and activations: float32 | bfloat16"),
    random_weights: bool = typer.Option(False, help="the named architecture with random weights"),
    implementation: str = typer.Option("auto", help="attend() implementation for OSCAR-cache layers"),
    fold_values: bool = typer.Option(True, help="fold R_V into the output projections (OSCAR-cache layers): "
                                                "attention skips its back-rotation"),
):
    """Generate text and report tokens/s, KV bytes and bits/element."""
    import jax
    import jax.numpy as jnp

    from oscar_jax.models import generate as gen, kv_policy, registry
    from oscar_jax.models.decoder import fold_values as fold

    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"--dtype {dtype!r}: expected float32 or bfloat16")
    try:
        decoder, tokenizer = registry.load(model, dtype=jnp.dtype(dtype), random_weights=random_weights, seed=seed)
    except registry.ModelNotInstalled as e:
        console.print(f"[red]{e}[/red]")
        raise typer.Exit(1)
    if rotations and kv != "oscar":
        raise typer.BadParameter(f"--kv {kv} takes no --rotations; calibrated rotations are for --kv oscar")
    try:
        policy = (load_calibration(rotations, decoder.cfg, implementation) if rotations
                  else kv_policy.make_policy(kv, implementation=implementation))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    if fold_values:
        try:
            decoder, policy = fold(decoder, policy)
        except ValueError as e:
            raise typer.BadParameter(f"{e} (--no-fold-values serves it unfolded)") from None
    if tokenizer is None:  # random weights without a tokenizer: UTF-8 bytes as ids
        ids = [b % decoder.cfg.vocab_size for b in prompt.encode()]
    else:
        ids = tokenizer.encode(prompt)
    out = gen.generate(decoder, policy, [ids], max_new_tokens=max_new_tokens,
                       sampling=gen.Sampling(temperature, top_p), key=jax.random.key(seed))
    new = out.tokens[0]
    console.print(tokenizer.decode(new) if tokenizer else " ".join(map(str, new)), markup=False, highlight=False)
    table = Table(title="oscar generate")
    table.add_column("")
    table.add_column("value", justify="right")
    for name, value in (
            ("device", jax.devices()[0].device_kind), ("jax", jax.__version__), ("model", str(model)), ("kv", policy.name),
            ("R_V folded into wo", str(decoder.values_folded)), ("prompt tokens", str(len(ids))),
            ("new tokens", str(len(new))), ("decode tokens/s", f"{out.decode_tokens_per_s:.1f}"),
            ("prefill s", f"{out.seconds['prefill']:.2f}"), ("compile s", f"{out.seconds['compile']:.1f}"),
            ("KV bytes (allocated)", f"{kv_policy.nbytes(out.kv):,}"),
            ("KV bits/element", f"{kv_policy.bits_per_element(out.kv):.2f}")):
        table.add_row(name, value)
    console.print(table)


def main() -> None:
    for module in COMMAND_MODULES:
        importlib.import_module(module)
    app(prog_name="oscar")


if __name__ == "__main__":
    sys.exit(main())
