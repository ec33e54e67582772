"""Passkey retrieval: prompt construction, and the real SmolLM2 reading a passkey
back through prefill + the jitted decode loop."""

import pytest

from oscar_jax.models import needle, registry
from oscar_jax.models.evaluate import scheme_policy


@pytest.fixture(scope="module")
def smollm2():
    return registry.load("smollm2")


@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_prompt_has_length_needle_depth_and_question(smollm2, depth):
    _, tok = smollm2
    ids = needle.needle_prompt(tok, 700, depth, 48213)
    assert len(ids) == 700
    text = tok.decode(ids)
    assert text.endswith(needle.QUESTION) and text.count("48213") == 2
    at = text.index("The pass key is 48213")
    before = text[:at].count("The grass is green")
    total = text.count("The grass is green")
    assert abs(before / total - depth) < 0.1
    with pytest.raises(ValueError, match="too short"):
        needle.needle_prompt(tok, 20, 0.5, 1)


def test_bf16_cache_retrieves_passkey_through_decode_loop(smollm2):
    decoder, tok = smollm2
    res = needle.run(decoder, tok, scheme_policy("bf16"), "bf16", [512], [0.5], trials=2, seed=3)
    assert len(res) == 1 and res[0].trials == 2 and res[0].bpe == 16.0
    assert res[0].accuracy == 1.0


def test_needle_cli_writes_a_record(tmp_path):
    """oscar needle --json: a results record, one row per (scheme, length, depth)."""
    from typer.testing import CliRunner

    from oscar_jax.models import results
    from oscar_jax.models.cli import app

    out = tmp_path / "needle.json"
    result = CliRunner().invoke(app, ["needle", "--model", "smollm2", "--lengths", "512", "--depths", "0.2,0.8",
                                      "--kv", "bf16", "--trials", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rec = results.read(out)
    assert rec["device"] == "cpu" and rec["command"].startswith("oscar ")
    assert [(r["model"], r["kv"], r["length"], r["depth"], r["trials"]) for r in rec["rows"]] == [
        ("smollm2", "bf16", 512, 0.2, 1), ("smollm2", "bf16", 512, 0.8, 1)]
