"""Token embedding, weight [151936, 4096] bf16, on the H200: ours vs eager, torch.compile and Liger.

    python benchmarks/embedding.py --out benchmarks/results [--quick]

Implementations, side by side in one run:
  triton   TritonEmbeddingOp (backward: stable sort + one program per run of equal ids, no atomics)
  eager    torch.nn.functional.embedding
  compile  torch.compile(eager)
  liger    LigerEmbeddingFunction (liger_kernel.ops.experimental.embedding; its backward uses
           atomic adds, so it is not deterministic); "unavailable" if absent
Modes: forward; backward alone (through a retained graph); forward+backward.
Bytes: forward reads and writes tokens x hidden; backward reads dy (tokens x hidden) and writes
the dense [V, H] weight gradient (1.24 GB, which dominates). Ids uniform over the vocabulary, plus
a skewed case at the main shape: half of the tokens are one id (a padding id, say), which puts a
long run of one id (our backward splits it into segments of embedding.SEGMENT rows). At the main
shape, each implementation's GPU time from CUDA graph replay next to its as-called time (their
difference is the host cost per call: Python, autograd, sort and launches).
"""

from __future__ import annotations

import torch
from common import (
    HOST_OVERHEAD_COLUMNS,
    MODES,
    add_ratios,
    arg_parser,
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

from rl_engine.kernels.ops.triton.embedding import embedding as ours

VOCAB, HIDDEN = 151936, 4096
MAIN_TOKENS = 8192
DTYPE = torch.bfloat16
DEVICE = "cuda"


def implementations() -> dict:
    impls = {
        "triton": ours.embedding,
        "eager": torch.nn.functional.embedding,
        "compile": torch.compile(torch.nn.functional.embedding),
    }
    liger = optional_import("liger_kernel.ops.experimental.embedding")
    if liger is not None:
        impls["liger"] = lambda ids, weight: liger.LigerEmbeddingFunction.apply(weight, ids)
    return impls


def make_inputs(tokens: int, skewed: bool = False) -> list:
    ids = torch.randint(0, VOCAB, (1, tokens), device=DEVICE)
    if skewed:
        ids[0, ::2] = 0
    weight = torch.randn(VOCAB, HIDDEN, device=DEVICE, dtype=DTYPE)
    return [ids, weight]


def traffic_bytes(tokens: int, mode: str) -> int:
    rows, table = tokens * HIDDEN * DTYPE.itemsize, VOCAB * HIDDEN * DTYPE.itemsize
    forward, backward = 2 * rows, rows + table
    return {"forward": forward, "backward": backward, "forward+backward": forward + backward}[mode]


def sweep(impls: dict, cases: list[tuple[int, bool]], copy_gbps: float) -> list[dict]:
    rows = []
    for tokens, skewed in cases:
        inputs = make_inputs(tokens, skewed)
        ids = "skewed" if skewed else "uniform"
        for mode in MODES:
            row = {"tokens": tokens, "ids": ids, "mode": mode, "bytes": traffic_bytes(tokens, mode)}
            for name, fn in impls.items():
                result = measure(f"tokens={tokens} {ids} {mode} {name}", time_mode, mode, fn, inputs, [1])
                record_bandwidth(row, name, result, row["bytes"], copy_gbps)
            add_ratios(row, impls)
            rows.append(row)
        del inputs
    return rows


def main() -> int:
    args = parse_gpu_args(arg_parser(__doc__.splitlines()[0]))
    token_counts = [MAIN_TOKENS] if args.quick else [MAIN_TOKENS, 4 * MAIN_TOKENS, 2 * MAIN_TOKENS, MAIN_TOKENS // 2]
    cases = [(t, False) for t in token_counts] + [(MAIN_TOKENS, True)]
    copy = measure("copy ceiling", copy_ceiling)
    copy_gbps = copy.get("gb_per_s", float("nan"))
    impls = implementations()
    rows = sweep(impls, cases, copy_gbps)

    names = list(impls)
    print(f"\nembedding [{VOCAB}, {HIDDEN}] {DTYPE}; copy ceiling {copy_gbps:.0f} GB/s; ratio = peer ms / triton ms")
    print_table(rows, ["tokens", "ids", "mode", "triton_ms", "triton_gb_per_s", "triton_pct_copy", "triton_peak_mb"]
                + [c for n in names[1:] for c in (f"{n}_ms", f"{n}_pct_copy", f"ratio_vs_{n}")])

    payload = {
        "shape": {"vocab": VOCAB, "hidden": HIDDEN, "tokens": token_counts, "dtype": str(DTYPE)},
        "liger": "available" if "liger" in impls else "unavailable",
        "ceilings": {"copy": copy},
        "rows": rows,
    }
    write_json(args.out, "embedding", payload)  # written again below; kept if the CUDA graph part fails
    panels = []
    for mode in MODES:
        mode_rows = sorted((r for r in rows if r["mode"] == mode and r["ids"] == "uniform"), key=lambda r: r["tokens"])
        panels.append({
            "title": f"embedding {mode}", "xlabel": f"tokens (hidden {HIDDEN}, V {VOCAB}, bf16)",
            "ylabel": "GB/s", "x": [r["tokens"] for r in mode_rows],
            "series": {n: [r.get(f"{n}_gb_per_s") for r in mode_rows] for n in names},
            "hline": (copy_gbps, "copy"),
        })
    save_plot(args.out, "embedding", panels)

    called = {r["mode"]: r for r in rows if r["tokens"] == MAIN_TOKENS and r["ids"] == "uniform"}
    overhead = host_overhead(impls, make_inputs(MAIN_TOKENS), [1], called)
    print(f"\nhost cost per call at {MAIN_TOKENS} tokens, uniform ids: as called (L2 flushed, GPU waits for "
          "the host) vs GPU only (CUDA graph replay)")
    print_table(overhead, HOST_OVERHEAD_COLUMNS)
    write_json(args.out, "embedding", {**payload, "host_overhead": overhead})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
