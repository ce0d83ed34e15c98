"""SwiGLU (and SiLU) on [tokens, 12288] bf16 on the H200: ours vs eager, torch.compile and Liger-Kernel.

    python benchmarks/swiglu.py --out benchmarks/results [--quick]

Implementations, side by side in one run:
  swiglu  triton  TritonSwigluOp        eager  silu(gate) * up        compile  torch.compile(eager)
          liger   LigerSiLUMulFunction (liger_kernel.ops.swiglu; "unavailable" if absent)
  silu    triton  TritonSiluOp          eager  torch.nn.functional.silu   compile  torch.compile(eager)
Modes: forward; backward alone (through a retained graph); forward+backward.
Bytes (the op's minimum traffic): swiglu forward 3 tensors (gate, up read; y written), backward
5 (dy, gate, up read; d_gate, d_up written); silu forward 2, backward 3. Goal: >= 85% of the copy
bandwidth measured in this run. Also a (BLOCK, num_warps) sweep of our forward at the main shape.
Note: Liger's swiglu backward writes its gradients into the saved gate/up in place (less memory).
"""

from __future__ import annotations

import torch
from common import (
    GB,
    MODES,
    add_ratios,
    arg_parser,
    bench_ms,
    copy_ceiling,
    measure,
    optional_import,
    parse_gpu_args,
    print_table,
    record_bandwidth,
    save_plot,
    time_mode,
    write_json,
)

from rl_engine.kernels.ops.triton.activation import silu as ours_silu
from rl_engine.kernels.ops.triton.activation import swiglu as ours_swiglu

INTERMEDIATE = 12288
MAIN_TOKENS = 8192
DTYPE = torch.bfloat16
DEVICE = "cuda"
TENSORS_MOVED = {  # tensors of [tokens, INTERMEDIATE] read or written
    "swiglu": {"forward": 3, "backward": 5, "forward+backward": 8},
    "silu": {"forward": 2, "backward": 3, "forward+backward": 5},
}


def implementations() -> dict:
    def eager_swiglu(gate, up):
        return torch.nn.functional.silu(gate) * up

    swiglu = {"triton": ours_swiglu.swiglu, "eager": eager_swiglu, "compile": torch.compile(eager_swiglu)}
    liger = optional_import("liger_kernel.ops.swiglu")
    if liger is not None:
        swiglu["liger"] = liger.LigerSiLUMulFunction.apply
    silu = {"triton": ours_silu.silu, "eager": torch.nn.functional.silu,
            "compile": torch.compile(torch.nn.functional.silu)}
    return {"swiglu": swiglu, "silu": silu}


def make_inputs(op: str, tokens: int) -> list:
    count = 2 if op == "swiglu" else 1
    return [torch.randn(tokens, INTERMEDIATE, device=DEVICE, dtype=DTYPE) for _ in range(count)]


def sweep(op: str, impls: dict, tokens_list: list[int], copy_gbps: float) -> list[dict]:
    rows = []
    for tokens in tokens_list:
        inputs = make_inputs(op, tokens)
        for mode in MODES:
            moved = TENSORS_MOVED[op][mode] * tokens * INTERMEDIATE * DTYPE.itemsize
            row = {"op": op, "tokens": tokens, "mode": mode, "bytes": moved}
            for name, fn in impls.items():
                # Fresh copies per implementation: Liger's backward overwrites its inputs.
                args = [x.clone() for x in inputs]
                result = measure(f"{op} tokens={tokens} {mode} {name}", time_mode, mode, fn, args,
                                 list(range(len(args))))
                del args
                record_bandwidth(row, name, result, moved, copy_gbps)
            add_ratios(row, impls)
            rows.append(row)
        del inputs
    return rows


def launch_sweep(copy_gbps: float) -> list[dict]:
    """Our swiglu forward at the main shape by (BLOCK, num_warps); the code fixes one pair."""
    gate, up = make_inputs("swiglu", MAIN_TOKENS)
    moved = 3 * gate.numel() * DTYPE.itemsize
    fixed = (ours_swiglu.BLOCK, ours_swiglu.NUM_WARPS)
    rows = []
    try:
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)):
            ours_swiglu.BLOCK, ours_swiglu.NUM_WARPS = block, warps
            result = measure(f"swiglu forward BLOCK={block} num_warps={warps}",
                             lambda: {"ms": bench_ms(lambda: ours_swiglu.swiglu_forward(gate, up))})
            row = {"BLOCK": block, "num_warps": warps, **result}
            if "ms" in result:
                row["pct_copy"] = 100 * moved / (result["ms"] * 1e-3) / GB / copy_gbps
            rows.append(row)
    finally:
        ours_swiglu.BLOCK, ours_swiglu.NUM_WARPS = fixed
    return rows


def main() -> int:
    args = parse_gpu_args(arg_parser(__doc__.splitlines()[0]))
    tokens_list = [MAIN_TOKENS] if args.quick else [MAIN_TOKENS, 2 * MAIN_TOKENS, MAIN_TOKENS // 2]
    copy = measure("copy ceiling", copy_ceiling)
    copy_gbps = copy.get("gb_per_s", float("nan"))
    impls = implementations()
    rows = {op: sweep(op, fns, tokens_list, copy_gbps) for op, fns in impls.items()}
    launches = launch_sweep(copy_gbps)

    print(f"\ncopy ceiling {copy_gbps:.0f} GB/s; ratio = peer ms / triton ms")
    for op, fns in impls.items():
        names = list(fns)
        print(f"\n{op} [tokens, {INTERMEDIATE}] {DTYPE}")
        print_table(rows[op], ["tokens", "mode", "triton_ms", "triton_gb_per_s", "triton_pct_copy", "triton_peak_mb"]
                    + [c for n in names[1:] for c in (f"{n}_ms", f"{n}_pct_copy", f"ratio_vs_{n}")])
    print(f"\nour swiglu forward by launch configuration (fixed in code: BLOCK={ours_swiglu.BLOCK}, "
          f"num_warps={ours_swiglu.NUM_WARPS})")
    print_table(launches, ["BLOCK", "num_warps", "ms", "pct_copy"])

    write_json(args.out, "swiglu", {
        "shape": {"intermediate": INTERMEDIATE, "tokens": tokens_list, "dtype": str(DTYPE)},
        "liger": "available" if "liger" in impls["swiglu"] else "unavailable",
        "ceilings": {"copy": copy},
        "goals": {"pct_copy": 85},
        "rows": rows,
        "launch_sweep": launches,
    })
    panels = []
    for op, fns in impls.items():
        for mode in ("forward", "forward+backward"):
            mode_rows = sorted((r for r in rows[op] if r["mode"] == mode), key=lambda r: r["tokens"])
            panels.append({
                "title": f"{op} {mode}", "xlabel": f"tokens (x {INTERMEDIATE}, bf16)", "ylabel": "GB/s",
                "x": [r["tokens"] for r in mode_rows],
                "series": {n: [r.get(f"{n}_gb_per_s") for r in mode_rows] for n in fns},
                "hline": (copy_gbps, "copy"),
            })
    save_plot(args.out, "swiglu", panels)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
