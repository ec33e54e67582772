"""oscar_jax.models: the application layer (docs/ARCHITECTURE.md §1).

  registry     model names (smollm2, gemma3) -> files; `load(name|.gguf|HF dir)`
  config       `ModelConfig` from HF config.json or GGUF metadata
  decoder      the Flax NNX `Decoder` (Llama family and Gemma 3); `capture_qkv`
  weights      checkpoint-name table, `build_decoder`, `save_hf`
  gguf_loader, safetensors_loader, tokenizer
  kv_policy    cache policies (bf16, fp32, oscar, quarot, kivi, int2/4/8) -> `KVState`
  generate     `prefill`, `extend`, `decode_step`, `decode` (jitted loop), `generate`
  cli          the `oscar` typer app (other modules add commands to `cli.app`)
  calibration, evaluate, needle, corpus   `oscar calibrate`, `oscar eval`, `oscar needle`, the text splits
  results      the record schema of bench/results/ files and `--json` outputs
"""
