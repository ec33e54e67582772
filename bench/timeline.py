"""Per-program timeline of the Mosaic GPU decode kernel: when each program ends, on which SM.

Builds an instrumented copy of `mixed_attention_mgpu` (its kernel's source with three stamps per
program: %globaltimer, %clock64 and %smid at the program's start, after its first piece and
at its end, written to one more output) and runs the B8 H32/8 D128 decode at --seq tokens.
The stamps cost a few instructions per program, none per step. Reports the spread of the
programs' end times (the kernel ends with its last program), by kind of program (one or two
pieces, with or without a sink and ring), the time per history tile of the first and the
second piece of two-piece programs (a line fit over their lengths; the second piece also
holds the next pair's sink and ring) and the time each SM idles before the kernel's end.

Run on a GPU:  python bench/timeline.py --seq 131072 --out bench/results/timeline_h200.json

--model FILE (no GPU): from a saved timeline, fit each program's time as fixed + per tile +
a sink and ring + a second piece + its warpgroup's offset, keep each program's residual (its
SM's pace), and give the kernel end that other work lines (units per program, switch and
sink-and-ring costs) would have on that model.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import kernels as bk  # noqa: E402
from oscar_jax.pallas_kernels import layout  # noqa: E402
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu as mm  # noqa: E402
from oscar_jax.pallas_kernels.gpu import mixed_attention_mgpu_kernel as mk  # noqa: E402

# (text, its instrumented replacement) in the kernel's body (mixed_attention_mgpu_kernel.py)
# and in its entry point (mixed_attention_mgpu.py); each must occur once.
_KERNEL_PATCH = [
    ("sk_ref, sv_ref, rk_ref, rv_ref, o_ref, lse_ref, *, codes,",
     "sk_ref, sv_ref, rk_ref, rv_ref, o_ref, lse_ref, t_ref, *, codes, stamp_smem,"),
    ("    writes = flat < line.programs\n",
     "    writes = flat < line.programs\n    stamp_smem = stamp_smem.at[wg]\n    _stamp(stamp_smem, 0)\n"),
    ("    piece(0)\n    pl.when(line.pieces(u0, u1) > 1)(functools.partial(piece, 1))\n",
     "    piece(0)\n    _stamp(stamp_smem, 3)\n    pl.when(line.pieces(u0, u1) > 1)(functools.partial(piece, 1))\n"
     "    _stamp(stamp_smem, 6)\n    plgpu.commit_smem()\n    plgpu.copy_smem_to_gmem(stamp_smem, t_ref.at[flat])\n"
     "    plgpu.wait_smem_to_gmem(0)\n"),
    ("        red_smem=plgpu.SMEM(", "        stamp_smem=plgpu.SMEM((wgs, 16), jnp.int32),\n        red_smem=plgpu.SMEM("),
    ("                  jax.ShapeDtypeStruct((b, hkv, partials.max(), N), jnp.float32)],",
     "                  jax.ShapeDtypeStruct((b, hkv, partials.max(), N), jnp.float32),\n"
     "                  jax.ShapeDtypeStruct((-(-line.programs // wgs) * wgs, 16), jnp.int32)],"),
]
_WRAPPER_PATCH = [
    ("from . import mixed_attention_mgpu_kernel as kernel_lib\n",
     "kernel_lib = __import__('sys').modules[__name__ + '_kernel']\n"),
    ("    o_t, lse2 = kernel(", "    o_t, lse2, stamps = kernel("),
    ("    kernel = kernel_lib.history_kernel(\n",
     "    globals()['last_line'], globals()['last_warpgroups'] = line, config.warpgroups  # (for the summary)\n"
     "    kernel = kernel_lib.history_kernel(\n"),
    ("    return o.reshape(b, 1, hq, d), lse.reshape(b, 1, hq)",
     "    return o.reshape(b, 1, hq, d), lse.reshape(b, 1, hq), stamps"),
]

_STAMP = '''

from jaxlib.mlir import ir  # noqa: E402
from jaxlib.mlir.dialects import arith, llvm, memref  # noqa: E402


def _stamp(ref, col):
    """ref int32 [16] (shared memory): ref[col], ref[col + 1], ref[col + 2] = the low 32 bits
    of %globaltimer (ns) and of %clock64 (cycles), and %smid."""
    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
    def stamp(ctx, r):
        del ctx
        i32, i64, index = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64), ir.IndexType.get()
        g = llvm.inline_asm(i64, [], "mov.u64 $0, %globaltimer;", "=l", has_side_effects=True)
        c = llvm.inline_asm(i64, [], "mov.u64 $0, %clock64;", "=l", has_side_effects=True)
        s = llvm.inline_asm(i32, [], "mov.u32 $0, %smid;", "=r", has_side_effects=True)
        for k, v in enumerate((arith.trunci(i32, g), arith.trunci(i32, c), s)):
            memref.store(v, r, [arith.constant(index, col + k)])
    stamp(ref)
'''


def _patched(module, patch, name: str, extra: str = "") -> types.ModuleType:
    """`module`'s source with `patch` applied (and `extra` appended), as module `name` of the
    same package."""
    src = open(module.__file__).read()
    for old, new in patch:
        if src.count(old) != 1:
            raise RuntimeError(f"{os.path.basename(module.__file__)} changed: {old[:60]!r} is not there once")
        src = src.replace(old, new)
    mod = types.ModuleType(name)
    mod.__package__, mod.__file__ = module.__package__, module.__file__
    sys.modules[name] = mod  # (dataclasses look their module up; the entry point its kernel)
    exec(compile(src + extra, module.__file__, "exec"), mod.__dict__)
    return mod


def instrumented() -> types.ModuleType:
    """mixed_attention_mgpu with the stamps (its kernel's body patched too), as a module of
    the same package."""
    name = mm.__name__ + "_timed"
    _patched(mk, _KERNEL_PATCH, name + "_kernel", _STAMP)
    return _patched(mm, _WRAPPER_PATCH, name)


def summary(stamps: np.ndarray, line, warpgroups: int = 3) -> dict:
    """stamps int32 [slots, 16] of one call, line its WorkLine -> end times (us from the first
    start) by kind of program (and by the kind of its block: program k is warpgroup
    k % warpgroups of block k // warpgroups), and per SM."""
    st = stamps[:line.programs].astype(np.int64)
    t0 = st[:, 0].min()
    start, end = (st[:, 0] - t0) / 1e3, (st[:, 6] - t0) / 1e3
    u0, u1 = np.asarray(line.bounds[:-1]), np.asarray(line.bounds[1:])
    units, two = u1 - u0, np.asarray(line.pieces(u0, u1)) > 1
    dense = line.piece(u0, u1, 0)[1] | line.piece(u0, u1, 1)[1]  # a sink and ring in either piece
    pct = lambda x: {p: round(float(np.percentile(x, p)), 1) for p in (0, 10, 50, 90, 100)}
    block_two = _in_a_block_with(two, warpgroups)
    kinds = {}
    for name, m in (("one piece", ~two), ("two pieces", two), ("sink and ring", dense), ("history only", ~dense),
                    ("one piece, a block with a two-piece program", ~two & block_two),
                    ("one piece, a block of one-piece programs", ~two & ~block_two)):
        if m.any():
            kinds[name] = {"programs": int(m.sum()), "mean_units": round(float(units[m].mean()), 1),
                           "end_us": pct(end[m]), "us_per_unit": round(float(((end - start)[m] / units[m]).mean()), 3)}
    pieces = {}  # two-piece programs: time of each piece = fixed + per tile * its history tiles
    for name, i, t_begin, t_end in (("first", 0, st[:, 0], st[:, 3]), ("second", 1, st[:, 3], st[:, 6])):
        _, own_dense, lo, hi = line.piece(u0, u1, i)
        m = two & (own_dense if i else ~own_dense)  # the second piece starts with a sink and ring
        if m.sum() > 2:
            per_tile, fixed = np.polyfit(np.asarray(hi - lo)[m], (t_end - t_begin)[m] / 1e3, 1)
            pieces[name] = {"programs": int(m.sum()), "us_per_tile": round(float(per_tile), 3),
                            "fixed_us": round(float(fixed), 1)}
    last = {}
    for sm, e in zip(st[:, 2], end):
        last[int(sm)] = max(last.get(int(sm), 0.0), e)
    last_end = np.asarray(list(last.values()))
    return {"programs": line.programs, "start_spread_us": round(float(start.max()), 2), "end_us": pct(end),
            "kinds": kinds, "pieces": pieces, "sms": len(last), "sm_last_end_us": pct(last_end),
            "mean_sm_idle_before_end_us": round(float(end.max() - last_end.mean()), 1)}


def _in_a_block_with(marked: np.ndarray, warpgroups: int) -> np.ndarray:
    """marked bool [programs] -> bool [programs]: the program's block (program k is in block
    k // warpgroups) holds a marked program."""
    n = len(marked)
    return np.repeat(np.add.reduceat(marked, np.arange(0, n, warpgroups)) > 0, warpgroups)[:n]


def features(line, warpgroups: int = 3) -> np.ndarray:
    """float64 [programs, 7]: 1, history tiles, sinks and rings, whether a second piece,
    whether the program is warpgroup 0 or warpgroup 2 of its block (program k: k % warpgroups),
    and whether it is a one-piece program in a block with a two-piece one."""
    u0, u1 = np.asarray(line.bounds[:-1]), np.asarray(line.bounds[1:])
    pieces = [line.piece(u0, u1, i) for i in range(2)]  # a one-piece program's second: no tiles, no sink
    tiles = sum(np.asarray(t_end - t_begin) for _, _, t_begin, t_end in pieces)
    dense = sum(np.asarray(own, np.float64) for _, own, _, _ in pieces)
    wg = np.arange(len(u0)) % warpgroups
    two = np.asarray(line.pieces(u0, u1)) > 1
    return np.stack([np.ones(len(u0)), tiles, dense, two, wg == 0, wg == 2,
                     ~two & _in_a_block_with(two, warpgroups)], axis=1).astype(np.float64)


def fit(stamps: np.ndarray, line) -> dict:
    """stamps int32 [slots, 16] of one call -> the least-squares model of its programs'
    durations (us: fixed, per tile, per sink and ring, per second piece, warpgroup 0's and
    2's offset from 1's, a one-piece program's beside a two-piece one in its block), their
    residuals and their starts."""
    st = stamps[:line.programs].astype(np.int64)
    t0 = st[:, 0].min()
    start, end = (st[:, 0] - t0) / 1e3, (st[:, 6] - t0) / 1e3
    x = features(line)
    coef = np.linalg.lstsq(x, end - start, rcond=None)[0]
    return {"coef": coef, "residual": end - start - x @ coef, "start": start, "end_us": float(end.max())}


def modelled_end(model: dict, line) -> float:
    """The kernel end (us) of another work line on a fitted model: program k keeps the start
    and residual of the measured call's program k (the same block and SM)."""
    x = features(line)
    if len(x) > len(model["start"]):
        raise ValueError(f"line of {len(x)} programs: the model knows the pace of {len(model['start'])} only")
    return float((model["start"][:len(x)] + x @ model["coef"] + model["residual"][:len(x)]).max())


# The work line's costs when the timelines without a "line" entry were made (sessions 17-18):
# a sink and ring of 4 units, a switch of 8, no warpgroup offsets.
_SAVED_DENSE_UNITS, _SAVED_SWITCH = 4, 8


def saved_line(saved: dict):
    """The WorkLine of a saved timeline: its "line" entry, or (files before it had one) the
    B8 H8 line of its --seq at the bench's sink 64 and ring 256 and that time's costs, checked
    against its bounds."""
    if "line" in saved:
        return mm.WorkLine(**saved["line"], bounds=tuple(saved["bounds"]))
    tiles = -(-(saved["seq"] - 64 - 256) // (mm.ROWS * mm.TPB))
    bounds = tuple(saved["bounds"])
    line = mm.WorkLine.cut(64, tiles, _SAVED_DENSE_UNITS, bounds[1] - bounds[0], _SAVED_SWITCH)
    if line.bounds != bounds:
        raise ValueError("the saved bounds are not the B8 H8 line of its --seq: give the file a 'line' entry")
    return line


def model_lines(path: str) -> dict:
    """A saved timeline -> per call its fit and its `summary`, and the modelled kernel end of
    the lines (of its pairs and tiles) of 83-86 units a program, switch costs 4-9 and sinks
    and rings of 3-6 units that need no more programs than the measured one."""
    saved = json.load(open(path))
    line = saved_line(saved)
    models = [fit(np.asarray(s, np.int32), line) for s in saved["stamps"]]
    names = ("fixed_us", "us_per_tile", "sink_and_ring_us", "second_piece_us", "wg0_us", "wg2_us",
             "one_piece_beside_a_two_piece_us")
    out = {"fits": [dict(zip(names, np.round(m["coef"], 3).tolist()), residual_std_us=round(float(m["residual"].std()), 2),
                         end_us=round(m["end_us"], 1)) for m in models], "lines": [],
           "measured_line": {"programs": line.programs, "end_us": round(float(np.mean([m["end_us"] for m in models])), 2)}}
    for per_program, switch, dense_units in itertools.product(range(83, 87), range(4, 10), range(3, 7)):
        cut = mm.WorkLine.cut(line.pairs, line.tiles, dense_units, per_program, switch)
        if cut.programs <= line.programs:
            ends = [modelled_end(m, cut) for m in models]
            out["lines"].append({"per_program": per_program, "switch": switch, "dense": dense_units,
                                 "programs": cut.programs, "end_us": round(float(np.mean(ends)), 2)})
    out["lines"].sort(key=lambda r: r["end_us"])
    out["summaries"] = [summary(np.asarray(s, np.int32), line, saved.get("warpgroups", 3)) for s in saved["stamps"]]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help="a saved timeline: model other work lines on it (no GPU)")
    args = ap.parse_args()
    if args.model:
        res = model_lines(args.model)
        print(json.dumps({"fits": res["fits"], "measured line": res["measured_line"], "best lines": res["lines"][:5],
                          "summaries": res["summaries"]}))
        if args.out:
            json.dump(res, open(args.out, "w"), indent=1)
        return
    timed = instrumented()
    shape = bk.Shape("B8 H32/8 D128", 8, 32, 8, 128, args.seq)
    cache, params, _, _ = bk.build_oscar(shape, jax.random.key(7))
    q = jax.random.normal(jax.random.key(2), (8, 1, 32, 128), jnp.bfloat16)
    spec = cache.spec
    call = jax.jit(lambda qq, c: timed.mixed_attention(
        qq, layout.CacheArrays.of(c), sink=spec.sink, window=spec.window,
        bits=spec.quant.bits, levels=spec.quant.levels, softmax_scale=spec.head_dim ** -0.5,
        query_rot=params.query_rot_parts, query_rot_stats=params.query_rot_stats, out_dtype=qq.dtype,
        output_rot=None if params.v_folded else params.output_rot_parts))
    runs = [np.asarray(call(q, cache)[2]) for _ in range(args.runs + 1)][1:]  # the first one warms up
    line, wgs = timed.last_line, timed.last_warpgroups  # the call's work line and block, set when traced
    res = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "seq": args.seq,
           "command": "python bench/timeline.py " + " ".join(sys.argv[1:]),
           "summaries": [summary(r, line, wgs) for r in runs], "bounds": list(map(int, line.bounds)),
           "warpgroups": wgs,
           "line": {"pairs": line.pairs, "tiles": line.tiles, "dense": line.dense},
           "stamps": [r.tolist() for r in runs]}
    print(json.dumps(res["summaries"][-1], indent=1))
    if args.out:
        json.dump(res, open(args.out, "w"))


if __name__ == "__main__":
    main()
