"""Result records (oscar_jax.models.results), the committed bench/results files, and the bench
scripts' tables, all on the CPU."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from oscar_jax.models import results

ROOT = pathlib.Path(__file__).parents[1]
RESULTS = ROOT / "bench" / "results"


def _bench_module(name: str):
    """bench/<name>.py as a module (registered in sys.modules, as its dataclasses need; bench/ on
    the path, as when the script runs beside its neighbours)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv,want", [(["bench/kernels.py", "--reps", "5"], "python bench/kernels.py --reps 5"),
                                       (["/opt/venv/bin/oscar", "bench", "--kv", "bf16"], "oscar bench --kv bf16")])
def test_record_names_the_command_as_typed(monkeypatch, argv, want):
    monkeypatch.setattr("sys.argv", argv)
    assert results.record([])["command"] == want


def test_record_has_the_schema_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("OSCAR_COMMIT", "abc1234")
    rec = results.record([{"shape": "b8-128k", "ms": 0.188}], "python bench/kernels.py")
    assert list(rec) == list(results.KEYS)
    assert (rec["device"], rec["commit"], rec["command"]) == ("cpu", "abc1234", "python bench/kernels.py")
    assert len(rec["date"]) == 10 and rec["date"][4] == rec["date"][7] == "-"
    path = results.write(tmp_path / "h200" / "x.json", rec)
    assert results.read(path) == rec and not list(path.parent.glob("*.tmp"))
    with pytest.raises(ValueError, match="expected the keys"):
        results.write(tmp_path / "y.json", {**rec, "note": "extra"})
    with pytest.raises(ValueError, match="expected the keys"):
        results.check({k: v for k, v in rec.items() if k != "commit"})
    with pytest.raises(ValueError, match="'rows' must be a list"):
        results.check({**rec, "rows": {"shape": "b8-128k"}})


def test_commit_from_git_or_unrecorded(monkeypatch):
    monkeypatch.delenv("OSCAR_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        assert results.commit().removesuffix("-dirty") == head.stdout.strip()

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert results.commit() == "unrecorded"


@pytest.mark.parametrize("kind, folder", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                          ("cpu", "cpu"), ("TPU v5 lite", "tpu-v5-lite")])
def test_device_folder(kind, folder):
    assert results.device_folder(kind) == folder


def test_committed_results_follow_the_schema():
    """Every file under bench/results/ is a record in its device's folder; a plot has its record
    beside it; a file of several calls names each row's call, one of those it lists."""
    files = sorted(RESULTS.rglob("*"))
    records = [f for f in files if f.suffix == ".json"]
    assert records and {f.suffix for f in files if f.is_file()} <= {".json", ".png"}
    for path in records:
        rec = results.read(path)
        assert path.parent.parent == RESULTS and path.parent.name == results.device_folder(rec["device"]), path
        assert rec["rows"] and rec["jax"] and rec["commit"] and rec["date"], path
        calls = rec["command"].split(" ; ")
        if len(calls) > 1:
            assert {r["command"] for r in rec["rows"]} == set(calls), path
    for plot in (f for f in files if f.suffix == ".png"):
        assert plot.with_suffix(".json").exists(), plot


def test_kernels_table_of_a_cut_off_run(tmp_path, capsys):
    """bench/kernels.py --markdown: the table of a run its time limit cut off (the record is saved
    after every op timed): a row stopped after cuDNN shows that ratio, from the times, and n/a
    for torch; a row stopped in its first op shows n/a; an empty row (cut off while its cache
    was built), none."""
    kernels = _bench_module("kernels")
    cut = {"shape": "b8-128k", "bits_per_element": 2.28, "auto": "pallas_mosaic_gpu", "triton_ms": 0.784,
           "mgpu_ms": 0.1951, "auto_ms": 0.1951, "auto_GBps": 3143.0, "jax_cudnn_ms": 0.9686,
           "read_ceiling_GBps": 4676.0}
    rec = {"device": "NVIDIA H200", "jax": "0.11.2", "commit": "abc1234", "command": "python bench/kernels.py",
           "date": "2026-12-06",
           "rows": [cut, {"shape": "b8-32k", "bits_per_element": 2.38, "auto": "pallas_mosaic_gpu"}, {}]}
    path = tmp_path / "decode_attention.json"
    results.write(path, rec)
    kernels.main(["--markdown", str(path)])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| b8")]
    assert [r[0] for r in rows] == ["| b8-128k", "| b8-32k"]
    # ms, GB/s, % of the read ceiling, x cuDNN, x torch flash
    assert rows[0][3:8] == ["0.195", "3143", f"{100 * 3143 / 4676:.1f}", f"{0.9686 / 0.1951:.2f}", "n/a"]
    assert set(rows[1][3:-1]) == {"n/a"}


def test_kernels_shapes_by_name():
    kernels = _bench_module("kernels")
    assert kernels.parse_shapes("b8-128k, b8-32k") == ["b8-128k", "b8-32k"]
    assert kernels.parse_shapes("all") == list(kernels.SHAPES)
    shape = kernels.SHAPES["gemma3-b8-32k"]
    assert (shape.batch, shape.q_heads, shape.kv_heads, shape.head_dim, shape.seq) == (8, 4, 1, 256, 32768)
    with pytest.raises(SystemExit):
        kernels.main(["--shapes", "b8-128k,2"])


def test_accuracy_table_takes_bf16_from_the_same_text(tmp_path, capsys):
    """bench/accuracy_table.py: one table per call; a call without a bf16 row takes ΔPPL from the
    file's bf16 row over the same text and token count, not another's."""
    table = _bench_module("accuracy_table")
    row = lambda kv, ppl, tokens, text, command: {"kv": kv, "ppl": ppl, "kl": 0.05, "top1": 0.9, "bpe": 3.03,
                                                  "tokens": tokens, "eval_text": text, "command": command}
    rows = [row("bf16", 20.0, 100, "a", "c1"), row("oscar", 21.5, 100, "a", "c1"),
            row("bf16", 30.0, 50, "a", "c2"), row("oscar", 22.25, 100, "a", "c3")]
    path = tmp_path / "v.json"
    results.write(path, {**results.record(rows, "c1 ; c2 ; c3")})
    table.main([str(path)])
    out = capsys.readouterr().out
    assert out.count("| kv |") == 3 and "| oscar | 3.03 | 21.500 | +1.500 |" in out
    assert "| oscar | 3.03 | 22.250 | +2.250 |" in out


def test_accuracy_table_renders_every_committed_eval_and_needle_file(capsys):
    table = _bench_module("accuracy_table")
    paths = [p for p in sorted(RESULTS.rglob("*.json"))
             if any(k in json.loads(p.read_text())["rows"][0] for k in ("ppl", "accuracy"))]
    assert len(paths) >= 6
    table.main([str(p) for p in paths])
    assert capsys.readouterr().out.count("| kv |") >= len(paths)


@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_pareto_plot_from_the_committed_records(model, tmp_path):
    """bench/pareto.py on the committed eval records: every point is a committed row (same
    bits, PPL, KL), ΔPPL is against the bf16 row of the same text, the front holds exactly the
    oscar points no other oscar point beats, and the committed pareto record has these points."""
    from typer.testing import CliRunner
    import typer

    pareto = _bench_module("pareto")
    records = sorted(RESULTS.glob(f"cpu/accuracy_{model}*.json"))
    out = tmp_path / f"pareto_{model}.png"
    app = typer.Typer()
    app.command()(pareto.main)
    result = CliRunner().invoke(app, [*map(str, records), "--model", model, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 10_000
    points = results.read(out.with_suffix(".json"))["rows"]
    committed = [r for p in records for r in results.read(p)["rows"]]
    for p in points:
        assert any((r["kv"], r["bpe"], r["ppl"], r["kl"]) == (p["kv"], p["bpe"], p["ppl"], p["kl"]) for r in committed)
        assert p["dppl_pct"] == pytest.approx(100 * (p["ppl"] / p["bf16_ppl"] - 1))
    oscar = [p for p in points if p["kv"].startswith("oscar")]
    beats = lambda b, a: (b["bpe"] <= a["bpe"] and b["dppl_pct"] <= a["dppl_pct"] and b["kl"] <= a["kl"]
                          and b is not a and (b["bpe"], b["dppl_pct"], b["kl"]) != (a["bpe"], a["dppl_pct"], a["kl"]))
    for a in oscar:
        assert a["on_front"] == (not any(beats(b, a) for b in oscar)), a["label"]
    assert any(p["on_front"] for p in oscar) and any(not p["kv"].startswith("oscar") for p in points)
    mine = RESULTS / "cpu" / f"pareto_{model}.json"
    if mine.exists():
        assert results.read(mine)["rows"] == points
