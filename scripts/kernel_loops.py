#!/usr/bin/env python3
"""What a Triton kernel's loops cost per iteration, read from its machine code (SASS), on a CPU.

    python scripts/kernel_loops.py [--T 32768] [--target 90] [--json FILE]

Compiles the block-selection kernels ahead of time as nsa/attention/ops.py launches them at M7C's shape (12 query
heads over 2 KV heads, head dim 64, l=32 d=16 l'=64 n=16, bf16, batch 1, T tokens; the compressed branch's
log-sum-exps given): the fused one-launch kernel (kernels/select_topk.py) and the two launches of
kernels/select_two_pass.py, with and without packed documents. Each cubin is disassembled with the nvdisasm Triton
ships; a loop is the span from a backward branch's target to the branch. For each loop it counts what sets an
iteration's cost when few programs share an SM: instructions, barriers (BAR: every warp of the program waits), shared
stores / loads, warp shuffles, special-function ops (MUFU: exp, log), tensor-core ops (HGMMA / HMMA) and global
loads / stores; and the kernel's registers per thread (ptxas) and static instruction count. Static counts, not a
profile: a loop's branches are counted once whether taken or not, and nothing says how often it runs.
One JSON line (--json also writes it), then a table.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from train.core.env import disable_triton_interpreter

if __name__ == "__main__":  # before triton is imported (see scripts/compile_kernels.py)
    disable_triton_interpreter()

# opcode families counted per loop (an opcode's family: its name before the first dot)
FAMILIES = ("BAR", "STS", "LDS", "SHFL", "MUFU", "HGMMA", "HMMA", "LDG", "LDGSTS", "STG")
INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
LABEL = re.compile(r"^\s*\.(L_x_\d+):")
BRANCH_TARGET = re.compile(r"`\(\.(L_x_\d+)\)")
PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass
class Loop:
    """One backward branch's span of a kernel's SASS: [first, last] instruction indices."""

    first: int
    last: int
    instructions: int
    families: dict[str, int] = field(default_factory=dict)


def opcode(text: str) -> str:
    """'@P0 BAR.SYNC.DEFER_BLOCKING 0x0' -> 'BAR'."""
    return PREDICATE.sub("", text).split()[0].split(".")[0]


def sass_loops(sass: str) -> tuple[Loop, list[Loop]]:
    """A kernel's nvdisasm text -> (the whole kernel as one span, its loops in order of their branches)."""
    ops, labels, branches = [], {}, []
    for line in sass.splitlines():
        if m := LABEL.match(line):
            labels[m.group(1)] = len(ops)
        elif m := INSTRUCTION.match(line):
            text = m.group(2)
            if opcode(text) == "BRA" and (target := BRANCH_TARGET.search(text)):
                branches.append((len(ops), target.group(1)))
            ops.append(opcode(text))
    loops = []
    for at, label in branches:
        start = labels.get(label)
        if start is not None and start < at:  # a backward branch: the loop's body is [start, at]
            count = collections.Counter(ops[start:at + 1])
            loops.append(Loop(start, at, at + 1 - start, {f: count[f] for f in FAMILIES if count[f]}))
    count = collections.Counter(ops)
    return Loop(0, len(ops) - 1, len(ops), {f: count[f] for f in FAMILIES if count[f]}), loops


def disassemble(cubin: bytes) -> str:
    """nvdisasm (Triton's own copy) of a cubin: SASS text with labels."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def _capture():
    spec = importlib.util.spec_from_file_location("kernel_capture", Path(__file__).with_name("kernel_capture.py"))
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_report(launch, capability: int) -> dict:
    """Compile a recorded launch for sm_<capability>; its registers, instruction count and loops."""
    kernel, usage = _capture().compile_with_usage(launch, capability)
    whole, loops = sass_loops(disassemble(kernel.asm["cubin"]))
    return {"kernel": launch.name, "registers": usage.registers, "spill_bytes": usage.spill_stores,
            "instructions": whole.instructions, "families": whole.families,
            "loops": [asdict(loop) for loop in loops if loop.instructions > 1]}


def selection_launches(T: int) -> dict[str, object]:
    """The selection kernels' launches as the ops make them at M7C's shape (meta tensors: nothing runs)."""
    import torch

    from nsa.attention.impl.compression import num_compressed
    from nsa.attention.kernels.select_topk import fused_select_blocks
    from nsa.attention.kernels.select_two_pass import two_pass_select_blocks

    H_kv, G, hd, l, d, l_sel, n = 2, 6, 64, 32, 16, 64, 16
    meta = dict(device="meta")
    q = torch.empty(1, H_kv, G, T, hd, dtype=torch.bfloat16, **meta)
    ck = torch.empty(1, H_kv, num_compressed(T, l, d), hd, dtype=torch.bfloat16, **meta)
    lse = torch.empty(1, H_kv, G, T, dtype=torch.float32, **meta)
    frame = torch.empty(3, 1, T, dtype=torch.long, **meta)
    capture = _capture()
    out = {}
    with capture.capture_launches() as launches:
        fused_select_blocks(q, ck, 0, l, d, l_sel, n, lse=lse)
    out["fused"] = launches[0]
    with capture.capture_launches() as launches:
        two_pass_select_blocks(q, ck, 0, l, d, l_sel, n, lse=lse)
    out["two_pass_scores"], out["two_pass_top_n"] = launches
    with capture.capture_launches() as launches:
        two_pass_select_blocks(q, ck, 0, l, d, l_sel, n, frame=frame, lse=lse)
    out["two_pass_scores_documents"], out["two_pass_top_n_documents"] = launches
    return out


def table(rows: dict[str, dict]) -> str:
    """One row per kernel (its whole code) and one per loop."""
    head = "| launch | kernel | registers | span | instructions | " + " | ".join(FAMILIES) + " |"
    lines = [head, "|" + "---|" * (5 + len(FAMILIES))]
    for name, r in rows.items():
        spans = [("kernel", r["instructions"], r["families"])]
        spans += [(f"loop {i}", loop["instructions"], loop["families"]) for i, loop in enumerate(r["loops"])]
        for span, count, families in spans:
            cells = [name, r["kernel"], str(r["registers"]), span, str(count), *(str(families.get(f, 0)) for f in FAMILIES)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, default=32768, help="tokens (the top-n kernel is specialised on T / l')")
    ap.add_argument("--target", type=int, default=90, help="compute capability (80: A100, 90: H100)")
    ap.add_argument("--json", type=Path, help="also write the JSON line here")
    args = ap.parse_args()
    rows = {name: kernel_report(launch, args.target) for name, launch in selection_launches(args.T).items()}
    line = json.dumps({"bench": "kernel_loops", "T": args.T, "target": f"sm_{args.target}", "kernels": rows})
    print(line)
    print(table(rows))
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
