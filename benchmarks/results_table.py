"""docs/results.md and the README's results table from benchmarks/results/*.json: numbers never copied by hand.

    python benchmarks/results_table.py           # rewrites docs/results.md and the README's table
    python benchmarks/results_table.py --check   # exit 1 if either differs from what the JSON gives

A list of records in a result file becomes a table (one column per field); the other fields are listed above it.
Floats are shown to 4 significant digits; the JSON beside each section has the full values.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "results.md"

HEADER = """# Benchmark results on the H200

Generated from `benchmarks/results/*.json` by `python benchmarks/results_table.py`: do not edit by hand
(`tests/benchmarks/test_results_table.py` fails when this page and the JSON disagree). Each section is one
benchmark script's last run (`benchmarks/<name>.py`), with the run's environment and the ceilings it measured;
the PNG beside each JSON plots it. The README has one summary row per op; `docs/kernels.md` says what each
number cost and what was tried; `docs/evidence/` holds the logs.
"""


def fmt(value, cell: bool = True) -> str:
    """A value: floats to 4 significant digits, nested values as compact JSON (a long one in a table cell is
    left to the JSON), `|` escaped."""
    if isinstance(value, bool) or value is None:
        text = str(value)
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, separators=(", ", ": "), default=str, ensure_ascii=False)
        text = text if not cell or len(text) <= 160 else f"({len(value)} entries: see the JSON)"
    else:
        text = str(value)
    return " ".join(text.split()).replace("|", "\\|")


def is_table(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(r, dict) for r in value)


def table(rows: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return lines


def bullets(key: str, value, indent: str = "") -> list[str]:
    if isinstance(value, dict) and value:
        return [f"{indent}- {key}:"] + [line for k, v in value.items() for line in bullets(k, v, indent + "  ")]
    return [f"{indent}- {key}: {fmt(value, cell=False)}"]


def section(name: str, data: dict, depth: int = 3) -> list[str]:
    """The scalar and nested fields as a list, then each list of records as a table (sub-dicts recurse)."""
    lines, tables = [], []
    for key, value in data.items():
        if is_table(value):
            tables.append((key, value))
        elif isinstance(value, dict) and any(is_table(v) for v in value.values()):
            tables.append((key, value))
        else:
            lines += bullets(key, value)
    for key, value in tables:
        lines += ["", f"{'#' * depth} {name} / {key}", ""]
        lines += table(value) if isinstance(value, list) else section(f"{name} / {key}", value, depth + 1)
    return lines


# --- The README's summary: one row per op or system, each number read from the JSON. ---

PEERS = {"eager": "eager", "eager_bf16": "eager bf16", "eager_fp32": "eager fp32", "compile": "torch.compile",
         "compile_fp32": "torch.compile fp32", "liger": "Liger", "fa4": "FA4", "sdpa": "SDPA (cuDNN)",
         "sdpa_flash": "SDPA flash", "cublas": "cuBLAS", "grouped_mm_layer": "`_grouped_mm` layer",
         "transformers": "transformers", "hf_static": "HF generate, static cache + compile",
         "hf_dynamic": "HF generate (default)", "compiled": "torch.compile", "grouped_mm": "`torch._grouped_mm`",
         "cublas_loop": "cuBLAS loop"}


def _one(rows: list[dict], **where) -> dict:
    found = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    if len(found) != 1:
        raise ValueError(f"expected one row where {where}, found {len(found)}")
    return found[0]


def _ms(value: float) -> str:
    return f"{value:.3g} ms" if value >= 0.1 else f"{value * 1000:.3g} µs"


def _fastest_wide(row: dict, peers=("eager", "compile", "liger")) -> tuple[str, float]:
    """The fastest peer of a row that holds `<peer>_ms` for each peer."""
    timed = [(row[f"{p}_ms"], p) for p in peers if row.get(f"{p}_ms")]
    ms, peer = min(timed)
    return peer, ms


def _fastest_long(rows: list[dict], peers, field: str, **where) -> tuple[str, float]:
    """The fastest peer among rows with one `impl` each."""
    timed = [(r[field], r["impl"]) for r in rows if r["impl"] in peers and r.get(field)
             and all(r.get(k) == v for k, v in where.items())]
    ms, peer = min(timed)
    return peer, ms


def _goal(text: str, met: bool) -> str:
    return f"{text} {'✓' if met else '✗'}"


def _joined(rows, key: str, fmt: str = "{}") -> str:
    return " / ".join(fmt.format(r[key]) for r in rows)


def _row(label, ours, peer, ratio, goal, anchor) -> str:
    return f"| {label} | {ours} | {peer} | {ratio} | {goal} | [{anchor}](docs/results.md#{anchor}) |"


def summary(results: Path = RESULTS) -> str:
    """The README's results table (markdown), every number read from benchmarks/results/*.json."""
    def load(name):
        return json.loads((results / f"{name}.json").read_text())

    out = ["| op or system (H200, bf16, Qwen3-8B shapes) | ours | fastest peer | ratio | goal | all numbers |",
           "|---|---|---|---|---|---|"]
    long_peers = ("eager_fp32", "eager_bf16", "compile_fp32", "liger")

    logp = load("logp")["rows"]
    t = _one(logp, impl="triton", tokens=8192)
    for field, label, goal in (("fwd_ms", "logp fwd, 8192×151936",
                                _goal(f"≥ 85% of copy: {t['fwd_pct_copy']:.0f}%", t["fwd_pct_copy"] >= 85)),
                               ("fwd_bwd_ms", "logp fwd+bwd", _goal(
                                   f"≤ 1.25× the byte floor: {t['fwd_bwd_ms'] / t['fwd_bwd_floor_ms']:.2f}×",
                                   t["fwd_bwd_ms"] / t["fwd_bwd_floor_ms"] <= 1.25))):
        peer, ms = _fastest_long(logp, long_peers, field, tokens=8192)
        out.append(_row(label, _ms(t[field]), f"{PEERS[peer]} {_ms(ms)}", f"{ms / t[field]:.2f}×", goal, "logp"))

    lin = load("linear_logp")["rows"]
    t = _one(lin, impl="triton", tokens=4096)
    for field, x, label, limit in (("fwd_ms", "fwd_x_gemm", "linear_logp fwd, N=4096, V=151936", 1.10),
                                   ("fwd_bwd_ms", "fwd_bwd_x_gemm", "linear_logp fwd+bwd, N=4096", 4.3)):
        peer, ms = _fastest_long(lin, long_peers, field, tokens=4096)
        out.append(_row(label, _ms(t[field]), f"{PEERS[peer]} {_ms(ms)}", f"{ms / t[field]:.2f}×",
                        _goal(f"≤ {limit:.2f}× a GEMM: {t[x]:.2f}×", t[x] <= limit), "linear_logp"))

    loss = load("policy_loss")
    t = _one(loss["rows"], impl="triton", tokens=4096)
    peer, ms = _fastest_long(loss["rows"], long_peers, "fwd_bwd_ms", tokens=4096)
    goals = loss["goals"]
    out.append(_row("lm_head + GRPO loss fwd+bwd, N=4096", _ms(t["fwd_bwd_ms"]), f"{PEERS[peer]} {_ms(ms)}",
                    f"{ms / t['fwd_bwd_ms']:.2f}×",
                    _goal(f"≤ {goals['fwd_bwd_x_gemm']}× a GEMM: {t['fwd_bwd_x_gemm']:.2f}×",
                          t["fwd_bwd_x_gemm"] <= goals["fwd_bwd_x_gemm"]) + "; "
                    + _goal(f"memory ≤ {goals['work_pct_of_logits']}% of the logits: "
                            f"{t['work_pct_of_logits']:.1f}%", t["work_pct_of_logits"] <= goals["work_pct_of_logits"]),
                    "policy_loss"))

    for name, label, tokens, where, goal_of in (
            ("rms_norm", "rms_norm fwd+bwd, 32768×4096", 32768, {},
             lambda d, f, b: _goal(f"fwd ≥ {d['goals']['forward_pct_copy']}%, bwd ≥ {d['goals']['backward_pct_copy']}% "
                                   f"of copy: {f:.0f}% / {b:.0f}%", f >= d["goals"]["forward_pct_copy"]
                                   and b >= d["goals"]["backward_pct_copy"])),
            ("swiglu", "swiglu fwd+bwd, 16384×12288", 16384, {"op": "swiglu"},
             lambda d, f, b: _goal(f"≥ {d['goals']['pct_copy']}% of copy: {f:.0f}% / {b:.0f}%",
                                   min(f, b) >= d["goals"]["pct_copy"])),
            ("rope", "rope fwd+bwd, 32768×32×128", 32768, {},
             lambda d, f, b: _goal(f"≥ {d['goals']['pct_copy']}% of copy: {f:.0f}% / {b:.0f}%",
                                   min(f, b) >= d["goals"]["pct_copy"]))):
        data = load(name)
        rows = data["rows"]["swiglu"] if name == "swiglu" else data["rows"]
        both = _one(rows, tokens=tokens, mode="forward+backward", **where)
        fwd = _one(rows, tokens=tokens, mode="forward", **where)["triton_pct_copy"]
        bwd = _one(rows, tokens=tokens, mode="backward", **where)["triton_pct_copy"]
        peer, ms = _fastest_wide(both)
        out.append(_row(label, _ms(both["triton_ms"]), f"{PEERS[peer]} {_ms(ms)}", f"{ms / both['triton_ms']:.2f}×",
                        goal_of(data, fwd, bwd), name))

    emb = _one(load("embedding")["rows"], tokens=8192, ids="uniform", mode="backward")
    peer, ms = _fastest_wide(emb)
    out.append(_row("embedding bwd, 8192 tokens, V=151936", _ms(emb["triton_ms"]), f"{PEERS[peer]} {_ms(ms)}",
                    f"{ms / emb['triton_ms']:.2f}×", "deterministic, no atomics", "embedding"))

    mm = [r for r in load("matmul")["rows"] if r["M"] >= 4096]
    pct = [r["pct_of_cublas"] for r in mm]
    out.append(_row("matmul, M ≥ 4096 (q/o, k/v, gate/up, down, lm_head)", "rows bitwise M-invariant",
                    "cuBLAS (not M-invariant)", f"{min(pct) / 100:.2f}–{max(pct) / 100:.2f}×",
                    _goal(f"≥ 85% of cuBLAS: {min(pct):.0f}–{max(pct):.0f}%", min(pct) >= 85), "matmul"))

    att = load("attention")
    for mode, label in (("forward", "attention prefill fwd, head_dim 128, S=4k"),
                        ("forward+backward", "attention prefill fwd+bwd, head_dim 128, S=4k")):
        r = _one(att["prefill"], S=4096, head_dim=128, mode=mode)
        peer = r["fastest_peer"]
        out.append(_row(label, _ms(r["triton_ms"]), f"{PEERS[peer]} {_ms(r[f'{peer}_ms'])}",
                        f"{r['ratio_vs_fastest']:.2f}× ({r['ratio_vs_fastest_timing']})",
                        _goal(r["goal"], r["goal_status"] == "met"), "attention"))
    b1 = sorted((r for r in att["decode"] if r["batch"] == 1), key=lambda r: r["cached"])
    out.append(_row(f"attention decode, batch 1, {'/'.join(str(r['cached'] // 1024) for r in b1)}k cached",
                    " / ".join(_ms(r["triton_graph_ms"]) for r in b1),
                    "SDPA (cuDNN) " + " / ".join(_ms(r["sdpa_graph_ms"]) for r in b1),
                    " / ".join(f"{r['graph_ratio_vs_sdpa']:.2f}" for r in b1) + "×",
                    _goal(b1[0]["goal"], all(r["goal_status"] == "met" for r in b1)), "attention"))

    moe = load("moe")
    g = [r for r in moe["gemm_rows"] if r["impl"] == "triton_grouped" and r["tokens"] == 16384]
    layer = {r["impl"]: r for r in moe["layer_rows"] if r["tokens"] == 16384}
    out.append(_row("MoE layer fwd+bwd, Qwen3-30B-A3B, 16k tokens × top-8", _ms(layer["triton"]["fwd_bwd_ms"]),
                    f"{PEERS['grouped_mm_layer']} {_ms(layer['grouped_mm_layer']['fwd_bwd_ms'])}",
                    f"{layer['grouped_mm_layer']['fwd_bwd_ms'] / layer['triton']['fwd_bwd_ms']:.2f}×",
                    _goal("grouped GEMM ≥ 85% of the best peer: "
                          + " / ".join(f"{r['pct_of_best_peer']:.0f}%" for r in g),
                          min(r["pct_of_best_peer"] for r in g) >= 85), "moe"))

    mhc = _one(load("mhc")["rows"], hidden=4096, tokens=4096, mode="forward")
    out.append(_row("mHC site fwd, strict fp32 bitwise, hidden 4096, T=4096", _ms(mhc["triton_ms"]),
                    f"torch.compile {_ms(mhc['compiled_ms'])}", f"{1 / mhc['triton_over_compiled']:.2f}×",
                    _goal("≤ 1.5× torch.compile's time", mhc["within_goal_1.5x"]), "mhc"))

    ro = load("rollout")  # full depth, on the H200
    batch = ro["goals"]["min_batch"]  # the speed goal's smallest batch, at the shortest context measured there
    context = min(r["context"] for r in ro["rows"] if r["batch"] == batch and r["peer"] == "hf_static")
    ours = _one(ro["rows"], peer="triton_bf16", batch=batch, context=context)
    theirs = _one(ro["rows"], peer="hf_static", batch=batch, context=context)["decode_tok_s"]
    speed, floor = ro["goals"]["speedup_vs_hf"], ro["goals"]["floor_x"]
    out.append(_row(f"rollout decode, {ro['model']} ({ro['layers']} layers), batch {batch}, {context // 1024}k "
                    f"context", f"{ours['decode_tok_s']:.0f} tok/s",
                    f"{PEERS['hf_static']} {theirs:.0f} tok/s", f"{ours['decode_tok_s'] / theirs:.2f}×",
                    _goal(f"≥ {speed:g}× transformers at batch ≥ {batch}", ours["decode_tok_s"] / theirs >= speed)
                    + "; " + _goal(f"≤ {floor:g}× the byte floor: {ours['floor_x']:.2f}×", ours["floor_x"] <= floor),
                    "rollout"))

    ro = load("rollout_h100")  # the byte-floor goal's cells, full depth, the latest build measured (an H100)
    by_context: dict[int, list] = {}
    for r in sorted(ro["rows"], key=lambda r: (r["context"], r["batch"])):
        if r["peer"] == "triton_bf16":
            by_context.setdefault(r["context"], []).append(r)
    (short, cells), *longer = sorted(by_context.items())
    goal = ro["goals"]["floor_x"]
    out.append(_row(f"rollout decode step, {ro['model']} ({ro['layers']} layers), batch {_joined(cells, 'batch')}, "
                    f"{short // 1024}k context, **H100**", _joined(cells, "decode_step_ms_median", "{:.2f}") + " ms",
                    "byte floor (weights + KV ÷ copy) " + _joined(cells, "floor_ms", "{:.2f}") + " ms",
                    _joined(cells, "floor_x", "{:.2f}") + "× the floor",
                    _goal(f"≤ {goal:g}× the byte floor", all(r["floor_goal_met"] for r in cells)) + "".join(
                        f"; {c // 1024}k, batch {_joined(rows, 'batch')}: "
                        + _goal(_joined(rows, "floor_x", "{:.2f}") + "×", all(r["floor_goal_met"] for r in rows))
                        for c, rows in longer), "rollout_h100"))

    grpo = load("rollout_grpo_h100")
    w, rows = grpo["workload"], {r["peer"]: r for r in grpo["rows"]}
    ours, hf = rows["triton_bf16"], rows["hf_generate"]
    kl = grpo["bits"]["triton_bf16"]["metrics"]["rollout_corr/kl"]
    out.append(_row(f"GRPO rollout, {w['prompts']} prompts × {w['samples']}, {w['prompt_len']} + {w['new_tokens']} "
                    f"tokens, T={w['temperature']:g}, **H100**", f"{ours['tok_s']:.0f} tok/s",
                    f"HF generate, {hf.get('cache', 'static')} cache {hf['tok_s']:.0f} tok/s",
                    f"{ours['tok_s'] / hf['tok_s']:.2f}×",
                    _goal(f"rollout_corr/kl vs the trainer: {kl:g}", kl == 0) + "; "
                    + _goal("peak ≤ weights + KV + 2 GiB", ours["memory_goal_met"]), "rollout_grpo_h100"))

    ts = load("transformers_step")
    r = _one(ts["ratios"], impl="rl_engine", mode="compiled", shape="1x8192", task="train")
    out.append(_row("transformers Qwen3 patched, compiled train step, 1×8192", f"{r['time_ratio']:.2f}× the time",
                    "unpatched, compiled (SDPA)", f"{1 / r['time_ratio']:.2f}×",
                    _goal(f"≤ {r['time_goal']:g}× the time", r["time_goal_met"]), "transformers_step"))
    return "\n".join(out) + "\n"


README = ROOT / "README.md"
BEGIN, END = "<!-- results_table.py: begin -->\n", "<!-- results_table.py: end -->\n"


def readme_with_summary(readme: str, results: Path = RESULTS) -> str:
    """`readme` with the text between the BEGIN and END markers replaced by summary()."""
    head, found, rest = readme.partition(BEGIN)
    _, found_end, tail = rest.partition(END)
    if not (found and found_end):
        raise ValueError(f"README.md: the markers {BEGIN.strip()} and {END.strip()} are missing")
    return head + BEGIN + summary(results) + END + tail


def render(results: Path = RESULTS) -> str:
    out = [HEADER]
    files = sorted(results.glob("*.json"))
    out.append("Benchmarks: " + ", ".join(f"[{p.stem}](#{p.stem})" for p in files) + ".\n")
    for path in files:
        data = json.loads(path.read_text())
        out += [f"## {path.stem}", "", f"`benchmarks/results/{path.name}`"
                + (f", plot `{path.stem}.png`" if path.with_suffix(".png").exists() else ""), ""]
        out += section(path.stem, data)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is not up to date")
    args = parser.parse_args(argv)
    pages = {PAGE: render(), README: readme_with_summary(README.read_text())}
    if args.check:
        stale = [p.name for p, text in pages.items() if p.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(map(str, stale))}; run python benchmarks/results_table.py", file=sys.stderr)
            return 1
        return 0
    for path, text in pages.items():
        path.write_text(text)
    print(f"wrote docs/results.md and README.md's results table from {len(list(RESULTS.glob('*.json')))} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
