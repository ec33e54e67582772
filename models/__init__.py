"""oscar_jax.models: the application layer (docs/ARCHITECTURE.md §1).

  registry     model names (smollm2, gemma3) -> files, config-only architectures (llama3-8b,
               qwen3-8b: random weights); `load(name|.gguf|HF dir)`
  config       `ModelConfig` from HF config.json or GGUF metadata
  decoder      the Flax NNX `Decoder` (Llama family and Gemma 3), per-layer weights; `prefill_layer`,
               `capture_qkv`, `fold_values`
  weights      checkpoint-name table, `build_decoder`, `save_hf`
  gguf_loader, safetensors_loader, tokenizer
  kv_policy    cache policies (bf16, fp32, fp8, oscar, quarot, kivi, int2/4/8) -> `KVState`, one
               cache per layer
  dense_cache  `DenseCache` ([B, T_max, Hkv, D]; bf16, f32, fp8) and `KiviCache`
  generate     `prefill` (layer by layer), `extend`, `decode_step`, `decode` (jitted loop, in
               segments), `generate`
  bench        `oscar bench`: decode throughput per KV scheme at a KV budget, against the roofline
  cli          the `oscar` typer app (other modules add commands to `cli.app`)
  calibration, evaluate, needle, corpus   `oscar calibrate`, `oscar eval`, `oscar needle`, the text splits
  capture      q, k, v over windows of text: the calibration run's statistics and held-aside errors
  results      the record schema of bench/results/ files and `--json` outputs
"""
