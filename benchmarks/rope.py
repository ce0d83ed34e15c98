"""RoPE on x [1, tokens, 32, 128] bf16 on the H200: ours vs eager (HF style), torch.compile and Liger.

    python benchmarks/rope.py --out benchmarks/results [--quick]

Implementations, side by side in one run:
  triton   TritonRopeOp: cos/sin computed in the kernel from integer positions (fp32, libdevice)
  eager    HF apply_rotary_pos_emb: x * cos + rotate_half(x) * sin with cos/sin [1, S, D] in x's
           dtype precomputed outside the timing (HF computes them once per model forward)
  compile  torch.compile(eager)
  liger    LigerRopeFunction (liger_kernel.ops.rope) on q = x and a one-head k, the same
           precomputed cos/sin; "unavailable" if absent. Liger rotates in place.
Modes: forward; backward alone (through a retained graph); forward+backward.
Bytes: forward and backward each read and write x once (positions and cos/sin tables negligible).
Goal: >= 85% of the copy bandwidth measured in this run. Also: max |y - fp32 reference| per
implementation (the reference computes cos/sin in fp32; HF-style eager rounds them to bf16 first),
a num_warps sweep of our bare kernel (rope_apply) at the main shape, and, at the main shape, each
implementation's GPU time from CUDA graph replay next to its as-called time (their difference is the
host cost per call: Python, autograd, launches).
"""

from __future__ import annotations

import torch
from common import (
    GB,
    HOST_OVERHEAD_COLUMNS,
    MODES,
    add_ratios,
    arg_parser,
    bench_ms,
    copy_ceiling,
    host_overhead,
    measure,
    optional_import,
    parse_gpu_args,
    print_table,
    record_bandwidth,
    save_plot,
    time_mode,
    write_json,
)

from rl_engine.kernels.ops.pytorch.position.rope import NativeRopeOp, rope_cos_sin, rotate_half
from rl_engine.kernels.ops.triton.position import rope as ours

HEADS, HEAD_DIM, THETA = 32, 128, 1e6
MAIN_TOKENS = 16384
DTYPE = torch.bfloat16
DEVICE = "cuda"


def implementations() -> dict:
    def eager(x, positions, cos, sin, k):
        return x * cos.unsqueeze(2) + rotate_half(x) * sin.unsqueeze(2)

    impls = {
        "triton": lambda x, positions, cos, sin, k: ours.rope(x, positions, THETA),
        "eager": eager,
        "compile": torch.compile(eager),
    }
    liger = optional_import("liger_kernel.ops.rope")
    if liger is not None:
        def liger_rope(x, positions, cos, sin, k):
            q_out, _ = liger.LigerRopeFunction.apply(x.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return q_out.transpose(1, 2)

        impls["liger"] = liger_rope
    return impls


def make_inputs(tokens: int) -> list:
    x = torch.randn(1, tokens, HEADS, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    positions = torch.arange(tokens, device=DEVICE).unsqueeze(0)
    cos, sin = rope_cos_sin(positions, HEAD_DIM, THETA)
    k = torch.randn(1, tokens, 1, HEAD_DIM, device=DEVICE, dtype=DTYPE)
    return [x, positions, cos.to(DTYPE), sin.to(DTYPE), k]


def traffic_bytes(tokens: int, mode: str) -> int:
    tensor = tokens * HEADS * HEAD_DIM * DTYPE.itemsize
    return {"forward": 2 * tensor, "backward": 2 * tensor, "forward+backward": 4 * tensor}[mode]


def sweep(impls: dict, tokens_list: list[int], copy_gbps: float) -> list[dict]:
    rows = []
    for tokens in tokens_list:
        inputs = make_inputs(tokens)
        for mode in MODES:
            row = {"tokens": tokens, "mode": mode, "bytes": traffic_bytes(tokens, mode)}
            for name, fn in impls.items():
                args = [t.clone() for t in inputs]  # Liger rotates its inputs in place
                result = measure(f"tokens={tokens} {mode} {name}", time_mode, mode, fn, args, [0])
                del args
                record_bandwidth(row, name, result, row["bytes"], copy_gbps)
            add_ratios(row, impls)
            rows.append(row)
        del inputs
    return rows


def forward_errors(impls: dict) -> dict:
    inputs = make_inputs(MAIN_TOKENS)
    reference = NativeRopeOp(THETA)(x=inputs[0], positions=inputs[1])
    errors = {}
    for name, fn in impls.items():
        def error(f=fn):
            with torch.no_grad():
                y = f(*[t.clone() for t in inputs])
            diff = y.float() - reference
            return {"max_abs": diff.abs().max().item(),
                    "not_rounded_ref": int((y != reference.to(DTYPE)).sum()), "elements": y.numel()}
        errors[name] = measure(f"max |y - ref| {name}", error)
    return errors


def num_warps_sweep(copy_gbps: float) -> list[dict]:
    x, positions, *_ = make_inputs(MAIN_TOKENS)
    inv_freq = ours.cached_inv_freq(HEAD_DIM, THETA, x.device)
    rows = []
    for warps in (2, 4, 8, 16):
        result = measure(f"forward num_warps={warps}",
                         lambda n=warps: {"ms": bench_ms(lambda: ours.rope_apply(x, positions, inv_freq, num_warps=n))})
        row = {"num_warps": warps, **result}
        if "ms" in result:
            row["pct_copy"] = 100 * traffic_bytes(MAIN_TOKENS, "forward") / (result["ms"] * 1e-3) / GB / copy_gbps
        rows.append(row)
    return rows


def main() -> int:
    args = parse_gpu_args(arg_parser(__doc__.splitlines()[0]))
    tokens_list = [MAIN_TOKENS] if args.quick else [MAIN_TOKENS, 2 * MAIN_TOKENS, MAIN_TOKENS // 2, MAIN_TOKENS // 4]
    copy = measure("copy ceiling", copy_ceiling)
    copy_gbps = copy.get("gb_per_s", float("nan"))
    impls = implementations()
    rows = sweep(impls, tokens_list, copy_gbps)
    errors = forward_errors(impls)
    warps = num_warps_sweep(copy_gbps)

    names = list(impls)
    print(f"\nRoPE x [1, tokens, {HEADS}, {HEAD_DIM}] {DTYPE}; copy ceiling {copy_gbps:.0f} GB/s; "
          "ratio = peer ms / triton ms")
    print_table(rows, ["tokens", "mode", "triton_ms", "triton_gb_per_s", "triton_pct_copy", "triton_peak_mb"]
                + [c for n in names[1:] for c in (f"{n}_ms", f"{n}_pct_copy", f"ratio_vs_{n}")])
    print(f"\nforward error vs the fp32 reference at {MAIN_TOKENS} tokens (positions 0..{MAIN_TOKENS - 1}):")
    print_table([{"impl": n, **e} for n, e in errors.items()], ["impl", "max_abs", "not_rounded_ref", "elements"])
    print(f"\nour bare kernel (rope_apply, no wrapper) by num_warps at {MAIN_TOKENS} tokens "
          f"(fixed in code: rope.launch_config -> {ours.launch_config(HEADS, HEAD_DIM)[2]})")
    print_table(warps, ["num_warps", "ms", "pct_copy"])

    payload = {
        "shape": {"heads": HEADS, "head_dim": HEAD_DIM, "theta": THETA, "tokens": tokens_list, "dtype": str(DTYPE)},
        "liger": "available" if "liger" in impls else "unavailable",
        "ceilings": {"copy": copy},
        "goals": {"pct_copy": 85},
        "rows": rows,
        "forward_error_vs_fp32_reference": errors,
        "num_warps_sweep": warps,
    }
    write_json(args.out, "rope", payload)  # written again below; kept if the CUDA graph part fails
    panels = []
    for mode in ("forward", "forward+backward"):
        mode_rows = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["tokens"])
        panels.append({
            "title": f"RoPE {mode}", "xlabel": f"tokens (x {HEADS} x {HEAD_DIM}, bf16)", "ylabel": "GB/s",
            "x": [r["tokens"] for r in mode_rows],
            "series": {n: [r.get(f"{n}_gb_per_s") for r in mode_rows] for n in names},
            "hline": (copy_gbps, "copy"),
        })
    save_plot(args.out, "rope", panels)

    called = {r["mode"]: r for r in rows if r["tokens"] == MAIN_TOKENS}
    overhead = host_overhead(impls, make_inputs(MAIN_TOKENS), [0], called)
    print(f"\nhost cost per call at {MAIN_TOKENS} tokens: as called (L2 flushed, GPU waits for the host) "
          "vs GPU only (CUDA graph replay)")
    print_table(overhead, HOST_OVERHEAD_COLUMNS)
    write_json(args.out, "rope", {**payload, "host_overhead": overhead})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
