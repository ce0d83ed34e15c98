"""Batch-invariant persistent GEMM vs cuBLAS (torch.matmul) at the Qwen3-8B projection shapes.

    python benchmarks/matmul.py --out DIR [--quick]     forward TFLOP/s, % of cuBLAS, invariance flags
    python benchmarks/matmul.py --out DIR --sweep       candidate fixed configs at M = 8192, one shape

Goal (issue #5): >= 85% of cuBLAS at M >= 4096. At M <= 64 the product is bound by reading the
weight, so GB/s against the copy ceiling is reported too. The invariance flag compares row 0 of
the M = 4096 product with the same row computed alone (M = 1), bitwise, for both implementations.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's rl_engine

from common import (  # noqa: E402
    arg_parser,
    bench_ms,
    copy_ceiling,
    gemm_ceiling,
    measure,
    print_table,
    save_plot,
    write_json,
)

from rl_engine.kernels.ops.triton.linear.matmul import MatmulConfig, batch_invariant_mm, matmul_config  # noqa: E402

# Qwen3-8B (hidden 4096, 32 query / 8 KV heads of 128, intermediate 12288, vocab 151936): (N, K).
# q and o have the same shape, as do gate and up: measured once each.
SHAPES = {
    "q/o": (4096, 4096),
    "k/v": (1024, 4096),
    "gate/up": (12288, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
BATCH = [1, 8, 64, 4096, 8192]
QUICK_SHAPES, QUICK_BATCH = ["q/o", "lm_head"], [1, 64, 8192]
DTYPE = torch.bfloat16

# Candidates for the fixed bf16 configuration (all fit in the H200's 227 KB of shared memory).
SWEEP = [
    MatmulConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=True),
    MatmulConfig(128, 256, 64, group_m=8, num_warps=8, num_stages=3, tma=False),
    MatmulConfig(128, 256, 64, group_m=16, num_warps=8, num_stages=3, tma=True),
    MatmulConfig(256, 128, 64, group_m=8, num_warps=8, num_stages=3, tma=True),
    MatmulConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=True),
    MatmulConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=4, tma=True),
    MatmulConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=5, tma=True),
    MatmulConfig(64, 256, 64, group_m=8, num_warps=4, num_stages=4, tma=True),
    MatmulConfig(128, 256, 32, group_m=8, num_warps=8, num_stages=4, tma=True),
    MatmulConfig(128, 128, 64, group_m=8, num_warps=8, num_stages=4, tma=False),
]


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / (ms * 1e-3) / 1e12


def weight_gb_per_s(m: int, n: int, k: int, ms: float) -> float:
    """Bytes a GEMM must move at least (read a and b, write c) per second."""
    return (m * k + k * n + m * n) * DTYPE.itemsize / (ms * 1e-3) / 1e9


def row_invariant(mm, a: torch.Tensor, b: torch.Tensor) -> dict:
    """Row 0 of the full product vs the same row computed alone."""
    full, alone = mm(a, b)[:1], mm(a[:1].clone(), b)
    return {"bitwise": bool(torch.equal(full, alone)), "max_diff": (full.float() - alone.float()).abs().max().item()}


def bench_shape(name: str, n: int, k: int, batch: list[int], copy_gbps: float | None) -> list[dict]:
    w = torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5
    b = w.t()  # a linear layer's weight, read in place by both implementations
    rows = []
    for m in batch:
        a = torch.randn(m, k, device="cuda", dtype=DTYPE)

        def run(a=a, m=m):
            triton_ms = bench_ms(lambda: batch_invariant_mm(a, b))
            cublas_ms = bench_ms(lambda: torch.matmul(a, b))
            row = {
                "shape": name, "M": m, "N": n, "K": k,
                "triton_ms": triton_ms, "cublas_ms": cublas_ms,
                "triton_tflops": tflops(m, n, k, triton_ms), "cublas_tflops": tflops(m, n, k, cublas_ms),
                "pct_of_cublas": 100 * cublas_ms / triton_ms,
                "triton_gbps": weight_gb_per_s(m, n, k, triton_ms),
                "cublas_gbps": weight_gb_per_s(m, n, k, cublas_ms),
            }  # fmt: skip
            if copy_gbps:
                row["triton_pct_of_copy"] = 100 * row["triton_gbps"] / copy_gbps
            return row

        rows.append({"shape": name, "M": m, **measure(f"{name} M={m}", run)})
        del a
    a = torch.randn(4096, k, device="cuda", dtype=DTYPE)
    invariance = measure(
        f"{name} invariance",
        lambda: {"triton": row_invariant(batch_invariant_mm, a, b), "cublas": row_invariant(torch.matmul, a, b)},
    )
    for row in rows:
        if row["M"] == 4096 and "error" not in invariance:
            row["triton_invariant"] = invariance["triton"]["bitwise"]
            row["cublas_invariant"] = invariance["cublas"]["bitwise"]
            row["cublas_row0_max_diff"] = invariance["cublas"]["max_diff"]
    return rows


def run_default(args) -> None:
    shapes = QUICK_SHAPES if args.quick else list(SHAPES)
    batch = QUICK_BATCH if args.quick else BATCH
    print("ceilings ...", flush=True)
    gemm = measure("cuBLAS bf16 8192^3", gemm_ceiling)
    copy = measure("device copy", copy_ceiling)
    copy_gbps = copy.get("gb_per_s")
    rows = []
    for name in shapes:
        n, k = SHAPES[name]
        print(f"{name}: N={n} K={k}, config {matmul_config(DTYPE, n, k)}", flush=True)
        rows += bench_shape(name, n, k, batch, copy_gbps)

    columns = ["shape", "M", "triton_ms", "cublas_ms", "triton_tflops", "cublas_tflops", "pct_of_cublas",
               "triton_gbps", "triton_invariant", "cublas_invariant", "error"]  # fmt: skip
    print_table(rows, columns)
    large = [r["pct_of_cublas"] for r in rows if r["M"] >= 4096 and "pct_of_cublas" in r]
    summary = {
        "min_pct_of_cublas_at_m_ge_4096": min(large) if large else None,
        "goal_pct_of_cublas_at_m_ge_4096": 85,
        "all_triton_rows_invariant": all(r.get("triton_invariant", True) for r in rows),
    }
    print(summary)
    configs = {name: dataclasses.asdict(matmul_config(DTYPE, *SHAPES[name])) for name in shapes}
    write_json(args.out, "matmul", {
        "dtype": str(DTYPE), "ceilings": {"gemm": gemm, "copy": copy}, "configs": configs,
        "summary": summary, "rows": rows,
    })  # fmt: skip

    def series(key, m):
        return [next((r.get(key) for r in rows if r["shape"] == s and r["M"] == m), None) for s in shapes]

    big = max(batch)
    save_plot(args.out, "matmul", [
        {"title": f"bf16 forward, M={big}", "xlabel": "projection", "ylabel": "TFLOP/s", "kind": "bar",
         "x": shapes, "series": {"triton (batch-invariant)": series("triton_tflops", big),
                                 "cuBLAS": series("cublas_tflops", big)},
         "hline": (gemm["tflop_per_s"], "cuBLAS 8192^3") if "tflop_per_s" in gemm else None},
        {"title": "triton / cuBLAS", "xlabel": "M (tokens)", "ylabel": "% of cuBLAS", "kind": "bar",
         "x": batch, "series": {s: [next((r.get("pct_of_cublas") for r in rows if r["shape"] == s and r["M"] == m),
                                         None) for m in batch] for s in shapes},
         "hline": (85, "goal at M >= 4096")},
    ])  # fmt: skip


def run_sweep(args) -> None:
    name = args.sweep_shape
    n, k = SHAPES[name]
    m = 8192
    w = torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5
    b = w.t()
    a = torch.randn(m, k, device="cuda", dtype=DTYPE)
    cublas_ms = bench_ms(lambda: torch.matmul(a, b))
    cublas_decode_ms = bench_ms(lambda: torch.matmul(a[:1], b))
    print(f"sweep {name}: N={n} K={k} M={m}; cuBLAS {tflops(m, n, k, cublas_ms):.0f} TFLOP/s", flush=True)
    rows = []
    for cfg in SWEEP:
        label = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}" + (
            " tma" if cfg.tma else " ptr"
        )

        def run(cfg=cfg):
            mm = lambda x, y: batch_invariant_mm(x, y, config=cfg)
            ms = bench_ms(lambda: mm(a, b))
            decode_ms = bench_ms(lambda: mm(a[:1], b))
            return {
                "tflops": tflops(m, n, k, ms), "pct_of_cublas": 100 * cublas_ms / ms,
                "decode_us": 1e3 * decode_ms, "decode_pct_of_cublas": 100 * cublas_decode_ms / decode_ms,
                "invariant": row_invariant(mm, a[:4096], b)["bitwise"],
            }  # fmt: skip

        rows.append({"config": label, **dataclasses.asdict(cfg), **measure(label, run)})
    print_table(rows, ["config", "tflops", "pct_of_cublas", "decode_us", "decode_pct_of_cublas", "invariant", "error"])
    write_json(args.out, "matmul_sweep", {
        "shape": name, "N": n, "K": k, "M": m, "dtype": str(DTYPE),
        "cublas_tflops": tflops(m, n, k, cublas_ms), "cublas_decode_us": 1e3 * cublas_decode_ms, "rows": rows,
    })  # fmt: skip
    save_plot(args.out, "matmul_sweep", [
        {"title": f"{name} bf16, M={m}", "xlabel": "config", "ylabel": "% of cuBLAS", "kind": "bar",
         "x": [str(i) for i in range(len(rows))], "series": {"M=8192": [r.get("pct_of_cublas") for r in rows],
                                                            "M=1": [r.get("decode_pct_of_cublas") for r in rows]},
         "hline": (85, "goal")},
    ])  # fmt: skip


def main() -> int:
    parser = arg_parser("batch-invariant Triton GEMM vs cuBLAS at Qwen3-8B projection shapes")
    parser.add_argument("--sweep", action="store_true", help="time candidate fixed configs at M=8192 instead")
    parser.add_argument("--sweep-shape", default="q/o", choices=list(SHAPES), help="the shape --sweep uses")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    run_sweep(args) if args.sweep else run_default(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
