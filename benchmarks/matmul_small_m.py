"""Small-M (decode) GEMM on the H200: bits against the large-M path, weight bandwidth, config sweep.

    python benchmarks/matmul_small_m.py --out DIR [--quick] [--no-sweep]

Issue #54's goal: at M = 1..256 the batch-invariant GEMM reads the weights at >= 85% of the device
copy bandwidth (measured in this run) at the Qwen3-8B shapes, while a row's bits equal those of the
same row in an M = 4096 product. Three parts, each shape in its own error guard:
- bits: rows of products of M rows (every M in 1..256 for q/o; M in BATCH for the others, at two
  row offsets) against the same rows of the M = 4096 product, bitwise; the config each M ran is named;
- sweep: candidate small-M configs (BLOCK_N x stages x persistent, BLOCK_M = BLOCK_K = 64, 4 warps; --block-m,
  --block-k, --swap-ab widen it) timed at SWEEP_BATCH (--sweep-m) as the table would dispatch each (`dispatching`),
  each checked bitwise against the M = 4096 rows first; the best is printed as
  the line to paste into matmul.py's SMALL_M_CONFIGS (per-shape SMALL_M_OVERRIDES where one beats it);
- timing: at each M in BATCH, ours as dispatched (the small-M config up to its max_m), the large-M
  config forced (what ran before the small-M config), and cuBLAS (torch.matmul) at the same M.
Timings (TIMINGS below): the goal's figure is GPU time from CUDA-graph replay over copies of the weight
(do_bench_cudagraph median, as benchmarks/matmul.py's GPU-only column); eager do_bench with its L2 flush
is reported beside it.
GB/s counts the weight's bytes only (N*K*2): what a decode step must read; % is of the copy ceiling.
At M = 256 the product is compute-bound on an H200 (256 flop per weight byte is above the ridge:
85% of 4.3 TB/s would need ~930 TFLOP/s), so the goal cannot hold there for any implementation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's rl_engine

from common import arg_parser, bench_ms, copy_ceiling, measure, parse_gpu_args, print_table, save_plot, write_json  # noqa: E402,I001
from matmul import gpu_ms, weight_copies  # noqa: E402  (benchmarks/matmul.py: graph replay over weight copies)

import rl_engine.kernels.ops.triton.linear.matmul as table  # noqa: E402
from rl_engine.kernels.ops.triton.linear.matmul import (  # noqa: E402
    MatmulConfig,
    SmallMConfig,
    batch_invariant_mm,
    config_at,
    matmul_config,
    small_m_config,
    table_tiers,
)

# Qwen3-8B (hidden 4096, 32 query / 8 KV heads of 128, intermediate 12288, vocab 151936): (N, K).
SHAPES = {
    "q/o": (4096, 4096),
    "k/v": (1024, 4096),
    "qkv": (6144, 4096),
    "gate/up": (12288, 4096),
    "gate_up": (24576, 4096),
    "down": (4096, 12288),
    "lm_head": (151936, 4096),
}
QUICK_SHAPES = ["q/o", "k/v", "lm_head"]
EVERY_M_SHAPE = "q/o"  # the shape whose rows are checked at every M in 1..256
BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256]
FULL_M = 4096  # the large-M product whose rows are the reference
SWEEP_SHAPES = ["qkv", "k/v", "q/o", "gate_up", "down", "lm_head"]
# A fused product (one weight [q; k; v] or [gate; up]) must give each projection's own bits: its parts, as
# rows of the weight, are checked against the parts' own products (their own small-M configs).
FUSED_PARTS = {"qkv": [4096, 1024, 1024], "gate_up": [12288, 12288]}
SWEEP_BATCH = [1, 128]
SWEEP_MARGIN_PCT = 3  # a per-shape override must beat the global choice by this much
GOAL_PCT_OF_COPY = 85
DTYPE = torch.bfloat16
EAGER = {"warmup": 10, "rep": 50}  # do_bench budgets in ms: the whole run must stay under 2 minutes
GRAPH_REP_MS = 10
SWEEP_UNTIL_S = 80  # no sweep candidate starts later than this into the run (--sweep-until-s)
MATMUL_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "rl_engine", "kernels", "ops", "triton", "linear", "matmul.py")
SMEM_BYTES = 220 * 1024  # of the 227 KB a block may use on sm90, a margin for the epilogue and barriers
START = time.perf_counter()
TIMINGS = {
    "graph (the goal's figure)": f"triton.testing.do_bench_cudagraph median, rep {GRAPH_REP_MS} ms: calls replayed "
    "back to back from a CUDA graph (as a decode step runs), each reading the next of several copies of the weight "
    "(>= 256 MB in all, past the L2) so weights come from HBM; no host cost",
    "eager": f"triton.testing.do_bench median {EAGER}, L2 flushed before each call by zeroing 256 MB: the flush leaves "
    "the L2 full of dirty lines whose write-back competes with the next call's reads, and the call's launch is timed "
    "too, so small weights (q/o 32 MB, k/v 8 MB) read far below the copy rate here for any implementation",
}


def candidates(quick: bool, block_ks: list[int] | None = None, swap_ab: bool = False,
               block_ms: list[int] | None = None) -> list[MatmulConfig]:
    """Small-M candidates in the large config's instruction family (BLOCK_M 64, 4 warps; `block_ms`: each of these
    BLOCK_M, a warpgroup of 4 warps per 64 rows). BLOCK_K: the large config's, or each of `block_ks` (a multiple of
    it is the same k16 wgmma chain, longer per step: whether the bits hold is what the sweep's bit check shows) with
    as many stages as fit shared memory (at most 8). swap_ab: swapped tiles instead (MatmulConfig.swap_ab: 8 or 16
    activation rows against 64 or 128 weight rows)."""
    stages = lambda rows, bn, bk: min(8, SMEM_BYTES // ((rows + bn) * bk * DTYPE.itemsize))  # noqa: E731
    if swap_ab:
        return [MatmulConfig(bm, bn, bk, group_m=8, num_warps=4, num_stages=stages(bm, bn, bk), persistent=p,
                             swap_ab=True)
                for bk in block_ks or [matmul_config(DTYPE, 4096, 4096).block_k] for bm in (8, 16) for bn in (64, 128)
                for p in (True, False)]
    if not block_ks:
        block_k = matmul_config(DTYPE, 4096, 4096).block_k
        grid = [(bm, bn, block_k, st, p) for bm in block_ms or [64] for bn in (32, 64, 128) for st in (4, 6, 8)
                for p in (True, False)]
        if quick:
            grid = [g for g in grid if g[3] == 6]
    else:
        grid = [(bm, bn, bk, stages(bm, bn, bk), p) for bm in block_ms or [64] for bk in block_ks
                for bn in (32, 64, 128) for p in (True, False)]
    return [MatmulConfig(bm, bn, bk, group_m=8, num_warps=4 * bm // 64, num_stages=st, persistent=p)
            for bm, bn, bk, st, p in grid if st >= 2 and (bm + bn) * bk * DTYPE.itemsize * st <= SMEM_BYTES]


def label(cfg: MatmulConfig) -> str:
    grid = "persistent" if cfg.persistent else "one-tile"
    swap = " swap_ab" if cfg.swap_ab else ""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} {grid}{swap}"


def source(cfg: MatmulConfig) -> str:
    """cfg as matmul.py's table writes it: the three block sizes, then the fields that are not the default."""
    defaults = MatmulConfig(0, 0, 0)
    extra = [f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)[3:]
             if getattr(cfg, f.name) != getattr(defaults, f.name)]
    return f"MatmulConfig({', '.join([str(cfg.block_m), str(cfg.block_n), str(cfg.block_k), *extra])})"


def weight_gbps(n: int, k: int, ms: float) -> float:
    return n * k * DTYPE.itemsize / (ms * 1e-3) / 1e9


def bits_differ(x: torch.Tensor, y: torch.Tensor) -> int:
    """Elements whose bits differ (raw bits: -0.0 vs 0.0 and NaN payloads count)."""
    return int((x.view(torch.int16) != y.view(torch.int16)).sum().item())


def offsets(m: int) -> list[int]:
    return [0, FULL_M - m] if m < FULL_M else [0]


def check_rows(mm, a: torch.Tensor, b: torch.Tensor, full: torch.Tensor, batch) -> dict:
    """{M: elements differing from the M = 4096 product's rows, summed over the row offsets}."""
    return {m: sum(bits_differ(mm(a[s : s + m].clone(), b), full[s : s + m]) for s in offsets(m)) for m in batch}


def parts_differ(a: torch.Tensor, w: torch.Tensor, full: torch.Tensor, sizes: list[int]) -> dict:
    """{M: elements of the fused product's rows differing from each part's own product} at M in BATCH and FULL_M."""
    out = {}
    for m in [*BATCH, FULL_M]:
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        out[m] = sum(bits_differ(batch_invariant_mm(a[:m].clone(), w[r : r + n].t()), full[:m, r : r + n])
                     for r, n in zip(starts, sizes))
    return out


def eager_ms(fn) -> float:
    return bench_ms(fn, **EAGER)


def graph_ms(mm, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    return gpu_ms(mm, x, weights, rep=GRAPH_REP_MS)


@contextlib.contextmanager
def dispatching(cfg: MatmulConfig, n: int, k: int):
    """The table's dispatch at (N, K) with cfg as its only small-M tier (M <= max(BATCH)): a candidate is timed as the
    table would launch it (a decode tier's PDL and L2 prefetch; `config=` would launch it as a plain product, which
    measured up to 12% apart on an H100)."""
    key, saved = (str(DTYPE).removeprefix("torch."), n, k), dict(table.SMALL_M_OVERRIDES)
    table.SMALL_M_OVERRIDES[key] = SmallMConfig(max(BATCH), cfg)
    table._plans.clear()
    try:
        yield
    finally:
        table.SMALL_M_OVERRIDES.clear()
        table.SMALL_M_OVERRIDES.update(saved)
        table._plans.clear()


def sweep_shape(name, a, b, weights, full, n, k, configs, copy_gbps) -> list[dict]:
    rows = []
    for cfg in configs:
        if time.perf_counter() - START > SWEEP_UNTIL_S:  # the run must end within 2 minutes
            rows.append({"shape": name, "config": label(cfg), **dataclasses.asdict(cfg),
                         "error": f"skipped: past {SWEEP_UNTIL_S} s"})
            continue

        def run(cfg=cfg):
            with dispatching(cfg, n, k):
                differ = check_rows(batch_invariant_mm, a, b, full, SWEEP_BATCH)
                row = {"bits_differ": sum(differ.values())}
                for m in SWEEP_BATCH:
                    x = a[:m].clone()
                    row[f"ms_m{m}"] = graph_ms(batch_invariant_mm, x, weights)
                    if copy_gbps:
                        row[f"pct_copy_m{m}"] = 100 * weight_gbps(n, k, row[f"ms_m{m}"]) / copy_gbps
            return row

        row = {"shape": name, "config": label(cfg), **dataclasses.asdict(cfg), **measure(f"{name} {label(cfg)}", run)}
        rows.append(row)
    return rows


def _score(row: dict) -> float | None:
    """Geometric mean of a candidate's times over SWEEP_BATCH (None: failed or changed bits)."""
    times = [row.get(f"ms_m{m}") for m in SWEEP_BATCH]
    if row.get("bits_differ") != 0 or not all(times):
        return None
    return math.prod(times) ** (1 / len(times))


def recommend(rows: list[dict]) -> dict:
    """The candidate with the best geometric-mean time over the swept shapes and M, as a table line;
    per-shape override lines where a shape's best beats it by SWEEP_MARGIN_PCT."""
    fields = [f.name for f in dataclasses.fields(MatmulConfig)]
    scores = {(r["shape"], r["config"]): _score(r) for r in rows}
    shapes = sorted({r["shape"] for r in rows}, key=list(SHAPES).index)
    configs = list(dict.fromkeys(r["config"] for r in rows))
    complete = {c: [scores.get((s, c)) for s in shapes] for c in configs}
    complete = {c: v for c, v in complete.items() if all(v)}
    if not complete:
        return {"choice": "keep the table", "why": "no candidate measured on every swept shape with equal bits"}
    best = min(complete, key=lambda c: math.prod(complete[c]))
    cfg_of = {r["config"]: source(MatmulConfig(**{f: r[f] for f in fields})) for r in rows}
    rule = small_m_config(DTYPE, *SHAPES["q/o"])
    max_m = rule.max_m if rule else max(BATCH)
    dtype = str(DTYPE).removeprefix("torch.")
    out = {"best": best, "table_line": f'"{dtype}": SmallMConfig({max_m}, {cfg_of[best]}),',
           "overrides": []}  # fmt: skip
    for shape, base in zip(shapes, complete[best]):
        top = min((c for c in configs if scores.get((shape, c))), key=lambda c: scores[(shape, c)])
        gain = 100 * (base / scores[(shape, top)] - 1)
        if gain >= SWEEP_MARGIN_PCT:
            n, k = SHAPES[shape]
            line = f'("{dtype}", {n}, {k}): SmallMConfig({max_m}, {cfg_of[top]}),'
            out["overrides"].append(f"{line}  # {shape}: {gain:.0f}% faster there than the best overall")
    return out


NARROW_MAX_M = 16  # --apply: M = 1's winner gets a tier of its own up to this M
SOURCE_LINE_CHARS = 120  # ruff's line length: --apply writes a longer entry one tier a line


def _without_entry(lines: list[str], key: str) -> list[str]:
    """The table's lines less the entry for key: from its first line until its parentheses close."""
    out, depth = [], 0
    for x in lines:
        code = x.split("#")[0]
        if depth or code.strip().startswith(key):
            depth += code.count("(") - code.count(")")
        else:
            out.append(x)
    return out


def apply_overrides(sweep: list[dict], timing: list[dict], path: str = MATMUL_SOURCE) -> list[str]:
    """--apply: per swept shape, the table's tiers (matmul.table_tiers, the first split at NARROW_MAX_M so that M = 1
    has its own, and split so that each swept M ends a tier; a swept M past them gets one) with each swept M's tier
    replaced by the fastest persistent candidate with equal bits, where it beats the config dispatched now at that M
    by SWEEP_MARGIN_PCT; written into matmul.py's SMALL_M_OVERRIDES (replacing the shape's entry, else added),
    adjacent tiers of one config merged. Returns the entries written."""
    with open(path) as f:
        text = f.read()
    head, rest = text.split("SMALL_M_OVERRIDES: ", 1)
    block, tail = rest.split("\n}\n", 1)
    written = []
    name = str(DTYPE).removeprefix("torch.")
    fields = [f.name for f in dataclasses.fields(MatmulConfig)]
    for shape in dict.fromkeys(r["shape"] for r in sweep):
        n, k = SHAPES[shape]
        tiers = list(table_tiers(DTYPE, n, k))
        if not tiers:
            continue  # no small-M config at this shape: nothing to tune
        if tiers[0].max_m > NARROW_MAX_M:
            tiers.insert(0, SmallMConfig(NARROW_MAX_M, tiers[0].config))
        large = table.table_config(DTYPE, n, k)
        for m in sorted(SWEEP_BATCH):  # each swept M ends a tier: winners at two Ms of one tier split it
            i = next((i for i, t in enumerate(tiers) if m <= t.max_m), None)
            if i is None:
                tiers.append(SmallMConfig(m, large))  # past the tiers: the large config runs there now
            elif m < tiers[i].max_m and any(m < m2 <= tiers[i].max_m for m2 in SWEEP_BATCH):
                tiers.insert(i, SmallMConfig(m, tiers[i].config))
        gains = []
        for m in SWEEP_BATCH:
            now = next((t["ours_ms"] for t in timing if t["shape"] == shape and t["M"] == m and t.get("ours_ms")), None)
            ranked = sorted((r for r in sweep if r["shape"] == shape and r.get("persistent") and r.get("tma")
                             and r.get("group_m") == 8 and r.get("bits_differ") == 0 and r.get(f"ms_m{m}")),
                            key=lambda r: r[f"ms_m{m}"])
            i = next((i for i, t in enumerate(tiers) if m <= t.max_m), None)
            gain = 100 * (now / ranked[0][f"ms_m{m}"] - 1) if now and ranked and i is not None else 0.0
            if gain >= SWEEP_MARGIN_PCT:
                winner = MatmulConfig(**{f: ranked[0][f] for f in fields if f in ranked[0]})
                tiers[i] = SmallMConfig(tiers[i].max_m, winner)
                gains.append(f"M = {m}: {gain:.0f}% faster")
        if not gains:
            continue
        while tiers and tiers[-1].config == large:
            tiers.pop()  # no small-M tier where the large config stays
        merged = [t for i, t in enumerate(tiers) if i + 1 == len(tiers) or tiers[i + 1].config != t.config]
        parts = [f"SmallMConfig({t.max_m}, {source(t.config)})" for t in merged]
        value = parts[0] if len(parts) == 1 else f"({', '.join(parts)})"
        key = f'("{name}", {n}, {k})'
        entry = f"{key}: {value},  # {shape}"
        lines = [f"    {entry}"]
        if len(lines[0]) > SOURCE_LINE_CHARS:  # one tier a line, as a tuple of tiers
            lines = [f"    {key}: (  # {shape}", *[f"        {p}," for p in parts], "    ),"]
        block = "\n".join([*_without_entry(block.split("\n"), key), *lines])
        written.append(f"{entry} ({', '.join(gains)} than the config dispatched now)")
    if written:
        with open(path, "w") as f:
            f.write(f"{head}SMALL_M_OVERRIDES: {block}\n}}\n{tail}")
    return written


def time_shape(name, a, b, weights, n, k, copy_gbps) -> list[dict]:
    large = matmul_config(DTYPE, n, k)
    rows = []
    for m in BATCH:

        def run(m=m):
            x = a[:m].clone()
            old = lambda x, y: batch_invariant_mm(x, y, config=large)  # noqa: E731  (what ran before)
            times = {"ours": graph_ms(batch_invariant_mm, x, weights), "large_cfg": graph_ms(old, x, weights),
                     "cublas": graph_ms(torch.matmul, x, weights),
                     "ours_eager": eager_ms(lambda: batch_invariant_mm(x, b)),
                     "cublas_eager": eager_ms(lambda: torch.matmul(x, b))}  # fmt: skip
            row = {"config": label(config_at(DTYPE, n, k, m))}
            for key, ms in times.items():
                row[f"{key}_ms"] = ms
                row[f"{key}_gbps"] = weight_gbps(n, k, ms)
                if copy_gbps:
                    row[f"{key}_pct_copy"] = 100 * row[f"{key}_gbps"] / copy_gbps
            row["speedup_vs_large_cfg"] = times["large_cfg"] / times["ours"]
            row["pct_of_cublas"] = 100 * times["cublas"] / times["ours"]
            return row

        rows.append({"shape": name, "M": m, "N": n, "K": k, **measure(f"{name} M={m}", run)})
    return rows


def run_shape(name: str, args, configs, copy_gbps) -> tuple[dict, list[dict], list[dict]]:
    n, k = SHAPES[name]
    w = torch.randn(n, k, device="cuda", dtype=DTYPE) / k**0.5
    b = w.t()  # a linear layer's weight, read in place
    a = torch.randn(FULL_M, k, device="cuda", dtype=DTYPE)
    full = batch_invariant_mm(a, b)
    weights = weight_copies(w)
    bits = {"shape": name, "N": n, "K": k, "full_m_config": label(config_at(DTYPE, n, k, FULL_M))}
    batch = range(1, max(BATCH) + 1) if name == EVERY_M_SHAPE else BATCH
    bits.update(measure(f"{name} bits", lambda: {
        "m_checked": f"{min(batch)}..{max(batch)}" if name == EVERY_M_SHAPE else list(batch),
        "configs": sorted({label(config_at(DTYPE, n, k, m)) for m in batch}),
        "differ_by_m": {m: d for m, d in check_rows(batch_invariant_mm, a, b, full, batch).items() if d},
    }))  # fmt: skip
    if name in FUSED_PARTS:
        bits.update(measure(f"{name} parts", lambda: {
            "parts_differ_by_m": {m: d for m, d in parts_differ(a, w, full, FUSED_PARTS[name]).items() if d}}))
    if "differ_by_m" in bits:
        bits["bitwise"] = not bits["differ_by_m"] and not bits.get("parts_differ_by_m")
    timing = time_shape(name, a, b, weights, n, k, copy_gbps)  # before the sweep: the goal's figures come first
    sweep = sweep_shape(name, a, b, weights, full, n, k, configs, copy_gbps) if configs and name in SWEEP_SHAPES else []
    return bits, sweep, timing


def _asdict(cfg) -> dict | None:
    return dataclasses.asdict(cfg) if cfg is not None else None


def main() -> int:
    global SWEEP_UNTIL_S, SWEEP_BATCH
    parser = arg_parser("small-M batch-invariant GEMM: bits vs M=4096, weight bandwidth, config sweep")
    parser.add_argument("--no-sweep", action="store_true", help="skip the candidate sweep")
    parser.add_argument("--shapes", type=lambda v: v.split(","), metavar="NAME,NAME",
                        help=f"shapes to run, of {', '.join(SHAPES)} (default: all; --quick: "
                        f"{', '.join(QUICK_SHAPES)})")
    parser.add_argument("--block-k", type=lambda v: [int(x) for x in v.split(",")], metavar="K,K",
                        help="sweep these BLOCK_K (stages fitted to shared memory) instead of the large config's")
    parser.add_argument("--swap-ab", action="store_true",
                        help="sweep swapped tiles (weight rows on the tensor core's 64-row side) instead")
    parser.add_argument("--block-m", type=lambda v: [int(x) for x in v.split(",")], metavar="M,M",
                        help="sweep these BLOCK_M (multiples of 64, 4 warps per 64) instead of 64 (unswapped tiles)")
    parser.add_argument("--sweep-m", type=lambda v: [int(x) for x in v.split(",")], metavar="M,M",
                        help=f"time sweep candidates at these M (default {','.join(map(str, SWEEP_BATCH))})")
    parser.add_argument("--sweep-until-s", type=float, default=SWEEP_UNTIL_S,
                        help=f"start no sweep candidate after this many seconds (default {SWEEP_UNTIL_S})")
    parser.add_argument("--apply", action="store_true",
                        help="write each swept shape's fastest bit-equal candidate into matmul.py's SMALL_M_OVERRIDES "
                        f"where it beats the config dispatched now by {SWEEP_MARGIN_PCT}%%")
    args = parse_gpu_args(parser)
    SWEEP_UNTIL_S = args.sweep_until_s
    SWEEP_BATCH = args.sweep_m or SWEEP_BATCH
    bad = [v for v in args.block_m or [] if v % 64] + [v for v in args.sweep_m or [] if not 1 <= v <= max(BATCH)]
    if bad:
        parser.error(f"--block-m (multiples of 64), --sweep-m (1..{max(BATCH)}): got {', '.join(map(str, bad))}")
    unknown = sorted(set(args.shapes or []) - set(SHAPES))
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    start = time.perf_counter()
    copy = measure("device copy", copy_ceiling)
    copy_gbps = copy.get("gb_per_s")
    print(f"copy ceiling {copy_gbps} GB/s", flush=True)
    shapes = args.shapes or (QUICK_SHAPES if args.quick else list(SHAPES))
    configs = [] if args.no_sweep else candidates(args.quick, args.block_k, args.swap_ab, args.block_m)
    bits, sweep, timing = [], [], []
    for name in shapes:
        print(f"{name}: N={SHAPES[name][0]} K={SHAPES[name][1]}", flush=True)
        result = measure(name, lambda name=name: dict(zip(("bits", "sweep", "timing"),
                                                          run_shape(name, args, configs, copy_gbps))))
        if "error" in result:
            bits.append({"shape": name, "error": result["error"]})
            continue
        bits.append(result["bits"])
        sweep += result["sweep"]
        timing += result["timing"]
        torch.cuda.empty_cache()

    print(f"\nbits: rows of M-row products vs the same rows of the M = {FULL_M} product")
    print_table(bits, ["shape", "m_checked", "configs", "full_m_config", "bitwise", "differ_by_m", "parts_differ_by_m",
                       "error"])
    if sweep:
        print("\nsweep (% of copy bandwidth, weight bytes, graph replay)")
        print_table(sweep, ["shape", "config", "bits_differ", *[f"{key}_m{m}" for m in SWEEP_BATCH
                                                                  for key in ("ms", "pct_copy")], "error"])
    print("\ntiming (% of copy bandwidth, weight bytes; graph replay unless _eager)")
    print_table(timing, ["shape", "M", "config", "ours_ms", "ours_pct_copy", "large_cfg_pct_copy", "cublas_pct_copy",
                         "speedup_vs_large_cfg", "pct_of_cublas", "ours_eager_pct_copy", "cublas_eager_pct_copy",
                         "error"])  # fmt: skip
    recommendation = recommend(sweep) if sweep else None
    goal_rows = [r for r in timing if "ours_pct_copy" in r]
    summary = {
        "all_rows_bitwise": all(b.get("bitwise") is True for b in bits),
        "all_sweep_candidates_bitwise": all(r["bits_differ"] == 0 for r in sweep if "bits_differ" in r),
        "sweep_candidates_checked": sum("bits_differ" in r for r in sweep),
        "goal_pct_of_copy": GOAL_PCT_OF_COPY,
        "ms_meeting_goal_by_shape": {s: [r["M"] for r in goal_rows if r["shape"] == s
                                         and r["ours_pct_copy"] >= GOAL_PCT_OF_COPY] for s in shapes},
        # where the small-M config lost to the large one: lower that shape's max_m (SMALL_M_OVERRIDES)
        "small_m_slower_than_large_cfg_at": {s: [r["M"] for r in goal_rows if r["shape"] == s and
                                                 r["speedup_vs_large_cfg"] < 1] for s in shapes},
        "min_ours_pct_copy_m_le_64": min((r["ours_pct_copy"] for r in goal_rows if r["M"] <= 64), default=None),
        "recommendation": recommendation,
        "seconds": time.perf_counter() - start,
    }  # fmt: skip
    print("\nsummary:", summary)
    if recommendation:
        print("\npaste into matmul.py SMALL_M_CONFIGS:\n    " + recommendation.get("table_line", "(none)"))
        for line in recommendation.get("overrides", []):
            print("SMALL_M_OVERRIDES:\n    " + line)
    applied = apply_overrides(sweep, timing) if args.apply and sweep else []
    for line in applied:
        print("applied to matmul.py SMALL_M_OVERRIDES: " + line)
    write_json(args.out, "matmul_small_m", {
        "applied": applied,
        "dtype": str(DTYPE), "copy": copy, "timings": TIMINGS,
        "table": {s: {"small_m": _asdict(small_m_config(DTYPE, *SHAPES[s])),
                      "large": _asdict(matmul_config(DTYPE, *SHAPES[s]))} for s in shapes},
        "summary": summary, "bits": bits, "sweep": sweep, "timing": timing,
    })  # fmt: skip
    save_plot(args.out, "matmul_small_m", [
        {"title": f"{who}, bf16", "xlabel": "M (tokens)", "ylabel": "% of copy bandwidth (weight bytes)",
         "x": BATCH, "logy": False, "hline": (GOAL_PCT_OF_COPY, "goal"),
         "series": {s: [next((r.get(key) for r in timing if r["shape"] == s and r["M"] == m), None) for m in BATCH]
                    for s in shapes}}
        for who, key in (("ours", "ours_pct_copy"), ("large-M config", "large_cfg_pct_copy"),
                           ("cuBLAS", "cublas_pct_copy"))
    ])  # fmt: skip
    print(f"done in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
