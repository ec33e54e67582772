"""Instruction mix of a Mosaic GPU kernel's loops, from its PTX, without a GPU.

On the GPU, Mosaic GPU writes each kernel's PTX and ptxas log when MOSAIC_GPU_DUMP_TO=DIR,
MOSAIC_GPU_DUMP_PTX=1 and MOSAIC_GPU_DUMP_PTXAS=1 are set (the device image has no nvdisasm,
so no SASS there). Here the PTX is compiled again with ptxas for sm_90a (with CUDA 13.0's
ptxas, the device's registers and spills: 168 and 56 / 92 bytes for session 27's decode
kernel; other versions may differ), disassembled with nvdisasm, and every loop that holds
--mmas wgmma instructions (xGMMA) is summarised: its length, its opcode counts and the source
lines (file:line, from the PTX's line table) with the most instructions. A loop is the run of
instructions, in address order, from a branch target to a branch back to it: blocks placed
elsewhere (a wait's retry) are not counted, and a run that holds an EXIT is not a loop (it
comes from a retry block placed after the kernel's end that branches back). The decode
kernel's history step is a loop of 32 IGMMA (16 for the scores, 16 for the V products); the
kernel unrolls its two pieces, so there are two such step loops, and two more for the masked
last steps.

ptxas and nvdisasm come with CUDA, or as the PyPI wheels `nvidia-cuda-nvcc` (13.x: ptxas
12.x rejects Mosaic GPU's PTX 9.0) and `nvidia-cuda-nvdisasm` (their bin/ folders;
--ptxas / --nvdisasm name them).

    python bench/sass.py kernel.ptx --mmas 32 --lines 12
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile

_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")  # address, then the instruction
_LABEL = re.compile(r"\s*\.L_x_(\d+):")
_SOURCE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
_BRANCH_TARGET = re.compile(r"\.L_x_(\d+)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    text: str  # without the address and the ';'
    line: str | None  # "file:line" of its source (nvdisasm -g); None before the line table's first entry

    @property
    def opcode(self) -> str:
        """The opcode without predicate and modifiers: `@!UP0 BRA ...` -> `BRA`."""
        return re.sub(r"^@!?U?P\w+\s+", "", self.text).split()[0].split(".")[0]


def parse(sass: str) -> tuple[list[Instruction], dict[str, int]]:
    """nvdisasm -c -g text -> (instructions in address order, label -> index of the
    instruction it marks)."""
    instructions, labels, pending, line = [], {}, [], None
    for row in sass.splitlines():
        if m := _LABEL.match(row):
            pending.append(m.group(1))
        elif m := _SOURCE.match(row):
            line = f"{os.path.basename(m.group(1))}:{m.group(2)}"
        elif m := _INSTRUCTION.match(row):
            labels.update((label, len(instructions)) for label in pending)
            pending = []
            instructions.append(Instruction(m.group(1), line))
    return instructions, labels


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction index of every loop (see the module's docstring), in address
    order."""
    out = []
    for i, ins in enumerate(instructions):
        if ins.opcode == "BRA" and (m := _BRANCH_TARGET.search(ins.text)):
            start = labels.get(m.group(1))
            if start is not None and start < i and all(x.opcode != "EXIT" for x in instructions[start:i]):
                out.append((start, i))
    return sorted(out)


def summarise(body: list[Instruction], top_lines: int) -> dict:
    """Length, wgmma count, opcode counts (most first) and the top_lines source lines with the
    most instructions of a loop body."""
    ops = collections.Counter(ins.opcode for ins in body)
    lines = collections.Counter(ins.line for ins in body if ins.line is not None)
    return {"instructions": len(body), "mmas": sum(n for op, n in ops.items() if op.endswith("GMMA")),
            "opcodes": dict(ops.most_common()), "lines": dict(lines.most_common(top_lines))}


def compile_ptx(ptx_path: str, ptxas: str, nvdisasm: str) -> tuple[str, str]:
    """(ptxas's -v report, nvdisasm -c -g text) of a PTX file, for sm_90a; exits with the
    tool's own message where one fails."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = f"{tmp}/kernel.cubin"
        try:
            report = subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-v", "-o", cubin, ptx_path],
                                    capture_output=True, text=True, check=True).stderr
            sass = subprocess.run([nvdisasm, "-c", "-g", cubin], capture_output=True, text=True, check=True).stdout
        except subprocess.CalledProcessError as e:
            sys.exit(f"{e.cmd[0]} failed:\n{e.stderr}")
    return report, sass


def _tool(name: str, given: str | None) -> str:
    """The path of ptxas or nvdisasm: `given` (which must be an executable) or on PATH."""
    path = shutil.which(given or name)
    if not path:
        wheel = "nvidia-cuda-nvcc" if name == "ptxas" else "nvidia-cuda-nvdisasm"
        sys.exit(f"--{name}={given}: not an executable" if given else
                 f"--{name}: no {name} on PATH; pass its path (CUDA's bin/, or the PyPI wheel {wheel}'s bin/)")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ptx", help="a kernel's PTX (MOSAIC_GPU_DUMP_PTX=1)")
    parser.add_argument("--mmas", type=int, default=32, help="summarise the loops with this many wgmma")
    parser.add_argument("--lines", type=int, default=12, help="source lines to list per loop")
    parser.add_argument("--ptxas", help="ptxas binary (default: on PATH)")
    parser.add_argument("--nvdisasm", help="nvdisasm binary (default: on PATH)")
    args = parser.parse_args()
    if not os.path.isfile(args.ptx):
        sys.exit(f"ptx={args.ptx}: no such file")
    report, sass = compile_ptx(args.ptx, _tool("ptxas", args.ptxas), _tool("nvdisasm", args.nvdisasm))
    print("\n".join(r.strip() for r in report.splitlines() if "Used" in r or "spill" in r))
    instructions, labels = parse(sass)
    summaries = [(span, summarise(instructions[span[0]:span[1] + 1], args.lines))
                 for span in loops(instructions, labels)]
    for (first, last), summary in summaries:
        if summary["mmas"] == args.mmas:
            print(f"\nloop of instructions {first}-{last}: {summary['instructions']} instructions")
            print("  opcodes:", ", ".join(f"{k} {v}" for k, v in summary["opcodes"].items()))
            print("  source lines (file:line instructions):",
                  ", ".join(f"{k} {v}" for k, v in summary["lines"].items()))
    if not any(summary["mmas"] == args.mmas for _, summary in summaries):
        print(f"\nno loop of {args.mmas} wgmma; the loops hold", sorted({s["mmas"] for _, s in summaries}))


if __name__ == "__main__":
    main()
