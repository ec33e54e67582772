"""Tokenizers from GGUF metadata or an HF `tokenizer.json`, built with `tokenizers`.

GGUF route (the one transformers' GGUF import takes, rebuilt on `tokenizers`
directly so the 3.12 environment needs no transformers):
  - `tokenizer.ggml.model == "gpt2"` (SmolLM2): byte-level BPE from the stored
    vocab and merges; pre-tokenizer = single digits + GPT-2 byte-level split
    (llama.cpp's "smollm"/"llama-bpe" pre-tokenisers).
  - `tokenizer.ggml.model == "llama"` (Gemma 3): SentencePiece BPE with byte
    fallback; merges are recovered from the token scores (a merge's priority is
    its merged piece's score); spaces become "▁"; user-defined pieces match whole.
Control tokens (token type 3) are special tokens; they never appear from text.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

from oscar_jax.models.gguf_loader import open_gguf, write_atomic

# GGUF token types (llama.cpp)
_NORMAL, _CONTROL, _USER_DEFINED, _BYTE = 1, 3, 4, 6


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
    """A `tokenizers.Tokenizer` plus the ids a generator needs."""

    tokenizer: Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    add_bos: bool

    def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
        """text -> token ids (BOS first when `add_bos`, default the model's convention)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.add_bos if add_bos is None else add_bos
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    @classmethod
    def from_gguf(cls, path: str | Path, cache_path: str | Path | None = None) -> "TextTokenizer":
        """From a GGUF file's tokenizer.ggml.* metadata. Building Gemma's 262K-piece
        BPE takes a while, so with `cache_path` the built tokenizer is saved there
        (tokenizer.json + a .ids.json of bos/eos/add_bos) and read back later."""
        if cache_path is not None and Path(cache_path).is_file():
            ids = json.loads(Path(f"{cache_path}.ids.json").read_text())
            return cls(Tokenizer.from_file(str(cache_path)), ids["bos_id"], tuple(ids["eos_ids"]), ids["add_bos"])
        f = open_gguf(path).fields
        meta = lambda k: f[k].contents() if k in f else None
        eos = meta("tokenizer.ggml.eos_token_id")
        add_bos = meta("tokenizer.ggml.add_bos_token")
        ids = dict(bos_id=meta("tokenizer.ggml.bos_token_id"), eos_ids=() if eos is None else (int(eos),),
                   add_bos=bool(add_bos) if add_bos is not None else False)
        kind = f["tokenizer.ggml.model"].contents()
        tokens = f["tokenizer.ggml.tokens"].contents()
        types = np.array(f["tokenizer.ggml.token_type"].contents(), np.int32)
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, f["tokenizer.ggml.merges"].contents())
        elif kind == "llama":
            tok = _sentencepiece_bpe(tokens, np.array(f["tokenizer.ggml.scores"].contents(), np.float32), types)
        else:
            raise ValueError(f"GGUF tokenizer.ggml.model={kind!r}: expected 'gpt2' or 'llama'")
        tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                for i in np.nonzero(types == _CONTROL)[0]])
        if cache_path is not None:  # ids first: the tokenizer file's presence means both exist
            write_atomic(Path(f"{cache_path}.ids.json"), lambda tmp: tmp.write_text(json.dumps(ids)))
            write_atomic(Path(cache_path), lambda tmp: tok.save(str(tmp)))
        return cls(tok, **ids)

    @classmethod
    def from_file(cls, path: str | Path, *, bos_id: int | None = None, eos_ids: tuple[int, ...] = (),
                  add_bos: bool = False) -> "TextTokenizer":
        """From an HF `tokenizer.json`."""
        return cls(Tokenizer.from_file(str(path)), bos_id, eos_ids, add_bos)


def read_chat_template(path: str | Path) -> str | None:
    """The Jinja chat template of a GGUF file (`tokenizer.chat_template`) or an HF directory
    (`tokenizer_config.json`'s `chat_template`); None when the model has none."""
    path = Path(path)
    if path.is_dir():
        config = path / "tokenizer_config.json"
        template = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template
    f = open_gguf(path).fields
    return f["tokenizer.chat_template"].contents() if "tokenizer.chat_template" in f else None


def _byte_level_bpe(tokens: list[str], merges: list[str]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: np.ndarray, types: np.ndarray) -> Tokenizer:
    """SentencePiece BPE: merge (l, r) ranks by the score of the piece l + r."""
    vocab = {t: i for i, t in enumerate(tokens)}
    mergeable = {t for t, ty in zip(tokens, types) if ty == _NORMAL}
    merges = []
    for piece, i in vocab.items():
        if types[i] != _NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-scores[i], vocab[left], vocab[right], left, right))
    merges.sort()
    tok = Tokenizer(models.BPE(vocab, [(m[3], m[4]) for m in merges], unk_token=tokens[3] if len(tokens) > 3 else None,
                               fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i in np.nonzero(types == _USER_DEFINED)[0]])
    return tok
