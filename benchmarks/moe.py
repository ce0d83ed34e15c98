"""MoE at Qwen3-30B-A3B shapes (hidden 2048, 128 experts, top-8, expert width 768, bf16): grouped GEMM and layer.

    python benchmarks/moe.py --out benchmarks/results [--quick] [--tokens 16384,65536] [--gemm-only]

`tokens` is T, the tokens entering the layer; each is routed to top-8 experts, so the grouped GEMM
has rows = 8T (4k, 16k, 64k tokens -> 32k, 128k, 512k rows; --quick: 4k tokens). Routing is
realistic-random: softmax of N(0,1) router logits (or of x @ router^T), top-8, so experts get
roughly T*8/128 rows each (min/max are recorded per row).

(1) The grouped GEMM alone, on rows already gathered by expert, for the two expert GEMM shapes:
    gate_up (N = 2*768, K = 2048: gate and up stacked, one product) and down (N = 2048, K = 768).
  triton_grouped         rl_engine's grouped GEMM (the `grouped_matmul` op's kernel, what moe.py runs):
                         one launch, each expert's rows in tiles of their own
  triton_loop            the loop it replaced: per expert, batch_invariant_mm(rows_e, W_e^T) (the
                         `matmul` op), then torch.cat; its bits are the grouped GEMM's
  triton_loop_gemm_only  the same without the cat (the GEMMs alone)
  grouped_mm             torch._grouped_mm(rows, W.transpose(-2,-1), offs=int32 cumulative counts):
                         one launch (CUTLASS grouped GEMM for bf16 on sm90 in torch 2.11)
  cublas_loop            per expert torch.mm(rows_e, W_e^T, out=slice): a Python loop of cuBLAS GEMMs
  cublas_dense_ref       one torch.mm of all rows against one expert: the ceiling (not a peer)
  TFLOP/s counts 2*rows*N*K; pct_of_best_peer = 100 * (faster of grouped_mm, cublas_loop) ms / ours;
  bitwise_vs_triton_loop: the grouped GEMM's output equals the loop's bit for bit
  (goal >= 85). On CUDA, graph_ms replays each from a CUDA graph: the GPU time without the host's
  per-launch cost (128 launches per loop).
(2) A whole MoE layer (router -> softmax -> top-8 renormalised -> experts -> combine), forward and
    forward + backward (gradients of the input, the router and every expert weight), peak memory:
  triton                 rl_engine.models.moe.moe_block under the triton_bf16 profile, with
                         local_experts on the stacked gate, up [E,I,H] and down [E,H,I] weights: what
                         the decoder's sparse layers call on the stacks a model holds
  grouped_mm_layer       written here: permute by expert, torch._grouped_mm for gate+up and down, combine
  transformers           Qwen3MoeSparseMoeBlock from a Qwen3MoeConfig, same weights, with the experts
                         implementation a transformers model picks by default (recorded; grouped_mm in 5.x)
  transformers_eager     the same block with experts_implementation="eager" (per-expert loop), when the
                         default is another
  *_x_grouped_mm = impl / grouped_mm_layer (goal for triton: <= 1.2 in ms and in peak memory).
  out_max_diff / dx_max_diff: max |impl - grouped_mm_layer| of the output and the input gradient
  (bf16; a near-tie in the top-8 can route one token differently and show as a larger diff).
  top_kernels (triton, grouped_mm_layer): the kernels taking the most time in one forward + backward
  (torch.profiler), printed after the table: where the layer's time goes; gpu_fwd_bwd_ms: all its
  kernels' time summed, gpu_x_grouped_mm the same ratio on it: the GPU's share of fwd_bwd_ms, which
  a slow host stretches (the grouped_mm layer's bincount reads back, so no CUDA graph for it).

--device cpu (hidden): toy shapes under the Triton interpreter, a wall-clock timer, no CUDA graphs,
no peak memory: every other code path, for tests/benchmarks/test_moe_smoke.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
import time

import torch
import torch.nn.functional as F
from common import (
    arg_parser,
    bench_ms,
    gemm_ceiling,
    measure,
    optional_import,
    peak_extra_bytes,
    print_table,
    save_plot,
    write_json,
)

DTYPE = torch.bfloat16


@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int
    experts: int
    top_k: int
    inter: int  # expert intermediate size
    tokens: tuple[int, ...]
    quick_tokens: tuple[int, ...]


QWEN3_30B_A3B = Shapes(hidden=2048, experts=128, top_k=8, inter=768, tokens=(4096, 16384, 65536), quick_tokens=(4096,))
# The CPU smoke path: small enough for the Triton interpreter, and some expert may get no rows.
TOY = Shapes(hidden=32, experts=4, top_k=2, inter=16, tokens=(8,), quick_tokens=(8,))

GEMM_IMPLS = ("triton_grouped", "triton_loop", "triton_loop_gemm_only", "grouped_mm", "cublas_loop", "cublas_dense_ref")
GEMM_PEERS = ("grouped_mm", "cublas_loop")
LAYER_IMPLS = ("grouped_mm_layer", "triton", "transformers", "transformers_eager")  # the first is the diff reference


class Timer:
    """CUDA: triton's do_bench (median ms, L2 flushed), peak memory, CUDA-graph GPU time.
    CPU (smoke path): the wall time of the one call that gives the result, no memory, no graphs."""

    def __init__(self, device: str, quick: bool):
        self.cuda = device == "cuda"
        self.warmup, self.rep = (10, 50) if quick else (25, 100)

    def timed(self, fn) -> tuple[float, object]:
        """(ms, fn()'s result)."""
        start = time.perf_counter()
        result = fn()  # on CUDA also the first call: Triton compiles, cuBLAS picks its kernels
        if self.cuda:
            return bench_ms(fn, warmup=self.warmup, rep=self.rep), result
        return (time.perf_counter() - start) * 1e3, result

    def peak_mb(self, fn) -> float | None:
        return peak_extra_bytes(fn) / 1e6 if self.cuda else None

    @staticmethod
    def graph_ms(fn) -> dict:
        from triton.testing import do_bench_cudagraph

        return {"ms": float(do_bench_cudagraph(fn, rep=20, return_mode="median"))}


def grouped_mm_unavailable(device: str) -> str | None:
    """None when torch._grouped_mm runs a bf16 2D x 3D product with offsets here, else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"unavailable: torch {torch.__version__} has no torch._grouped_mm"
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 0):
        return f"unavailable: torch._grouped_mm needs sm80+, this GPU is {torch.cuda.get_device_capability()}"
    try:
        a = torch.ones(16, 16, dtype=DTYPE, device=device)
        b = torch.ones(2, 16, 16, dtype=DTYPE, device=device)
        torch._grouped_mm(a, b.transpose(-2, -1), offs=torch.tensor([8, 16], dtype=torch.int32, device=device))
    except Exception as exc:  # noqa: BLE001 - any failure means this peer cannot run here
        return f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return None


def grouped_mm_path(device: str) -> str:
    """Which kernel torch._grouped_mm should pick (torch 2.11 GroupedBlas.cpp: bf16 on sm90/sm100 -> CUTLASS)."""
    if device != "cuda":
        return "cpu: per-group mm"
    major = torch.cuda.get_device_capability()[0]
    return "CUTLASS grouped GEMM (bf16, sm90/sm100)" if major in (9, 10) else "per-group mm fallback"


def make_weights(s: Shapes, device: str, seed: int = 0):
    """router [E,H], gate_up [E,2I,H] (gate rows then up rows, transformers' layout), down [E,H,I]; N(0, 1/fan_in)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=DTYPE).mul_(shape[-1] ** -0.5)

    return normal(s.experts, s.hidden), normal(s.experts, 2 * s.inter, s.hidden), normal(s.experts, s.hidden, s.inter)


def routed_counts(s: Shapes, tokens: int, device: str, seed: int) -> torch.Tensor:
    """Rows per expert [E] when `tokens` tokens each take the top-k of a softmax of random logits."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(tokens, s.experts, generator=gen, device=device)
    chosen = torch.softmax(logits, dim=-1).topk(s.top_k, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=s.experts)


# -- (1) the grouped GEMM alone -----------------------------------------------------------------

def gemm_impls(a: torch.Tensor, weight: torch.Tensor, counts: list[int], offs: torch.Tensor, grouped_status):
    """Zero-argument callables computing rows_e @ weight[e]^T for every expert e (a sorted by expert)."""
    device_counts = torch.tensor(counts, device=a.device)  # what the MoE layer passes: nothing read back
    from rl_engine.kernels.ops.triton.linear.grouped_matmul import grouped_matmul
    from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm

    parts = [(e, part) for e, part in enumerate(a.split(counts)) if part.shape[0]]
    starts = [0, *itertools.accumulate(counts)]
    bounds = [(e, starts[e], starts[e + 1]) for e in range(len(counts)) if counts[e]]

    def triton_loop_gemm_only():
        return [batch_invariant_mm(part, weight[e].t()) for e, part in parts]

    def triton_loop():
        return torch.cat(triton_loop_gemm_only())

    def cublas_loop():
        out = a.new_empty(a.shape[0], weight.shape[1])
        for e, start, end in bounds:
            torch.mm(a[start:end], weight[e].t(), out=out[start:end])
        return out

    impls = {"triton_grouped": lambda: grouped_matmul(a, weight, device_counts),
             "triton_loop": triton_loop, "triton_loop_gemm_only": triton_loop_gemm_only}
    impls["grouped_mm"] = grouped_status or (lambda: torch._grouped_mm(a, weight.transpose(-2, -1), offs=offs))
    impls["cublas_loop"] = cublas_loop
    impls["cublas_dense_ref"] = lambda: torch.mm(a, weight[0].t())
    return impls


def _max_abs_diff(x, ref) -> float:
    x = torch.cat(x) if isinstance(x, list) else x
    return (x.float() - ref.float()).abs().max().item()


def _rel_l2(x, ref) -> float:
    """||x - ref|| / ||ref||: unlike the max, barely moved by the few tokens a near-tie routes elsewhere."""
    ref = ref.float()
    return ((x.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def time_gemm(fn, reference, flops: int, timer: Timer, compare: bool) -> dict:
    ms, result = timer.timed(fn)
    row = {"ms": ms, "tflop_per_s": flops / (ms * 1e-3) / 1e12}
    if compare:  # the dense reference computes another product: nothing to compare
        row["max_abs_diff"] = _max_abs_diff(result, reference)
    return row


def gemm_section(s: Shapes, token_list, weights, timer: Timer, device: str, grouped_status) -> tuple[list, dict]:
    from rl_engine.kernels.ops.triton.linear.matmul import matmul_config

    _, gate_up, down = weights
    rows, configs = [], {}
    for tokens in token_list:
        counts = routed_counts(s, tokens, device, seed=tokens)
        host_counts = counts.tolist()
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        for gemm, weight in (("gate_up", gate_up), ("down", down)):
            n, k = weight.shape[1], weight.shape[2]
            configs[gemm] = dataclasses.asdict(matmul_config(DTYPE, n, k))
            a = torch.randn(sum(host_counts), k, device=device, dtype=DTYPE)
            base = {"gemm": gemm, "tokens": tokens, "rows": a.shape[0], "n": n, "k": k,
                    "min_rows_per_expert": min(host_counts), "max_rows_per_expert": max(host_counts)}
            flops = 2 * a.shape[0] * n * k
            impls = gemm_impls(a, weight, host_counts, offs, grouped_status)
            reference = impls["cublas_loop"]()
            results = {}
            for name, fn in impls.items():
                if isinstance(fn, str):
                    results[name] = {"error": fn}
                    continue
                label = f"{gemm} tokens={tokens} {name}"
                results[name] = measure(label, time_gemm, fn, reference, flops, timer, name != "cublas_dense_ref")
                if timer.cuda and "error" not in results[name]:
                    graphed = measure(f"{label} (CUDA graph)", timer.graph_ms, fn)
                    results[name]["graph_ms"] = graphed.get("ms")
                    if "error" in graphed:
                        results[name]["graph_error"] = graphed["error"]
                    else:
                        results[name]["graph_tflop_per_s"] = flops / (graphed["ms"] * 1e-3) / 1e12
            _add_peer_ratios(results)
            if "error" not in results["triton_grouped"]:
                results["triton_grouped"]["bitwise_vs_triton_loop"] = bool(
                    torch.equal(impls["triton_grouped"](), impls["triton_loop"]()))
            rows += [{**base, "impl": name, **result} for name, result in results.items()]
            del a, impls, reference
    return rows, configs


def _add_peer_ratios(results: dict) -> None:
    """pct_of_best_peer (and on the GPU-only time, graph_pct_of_best_peer) for our two loops;
    pct_of_dense_ref for every implementation (the dense GEMM's ms / its ms)."""
    dense = results["cublas_dense_ref"].get("ms")
    for result in results.values():
        if dense and result.get("ms"):
            result["pct_of_dense_ref"] = 100 * dense / result["ms"]
    for key, out in (("ms", "pct_of_best_peer"), ("graph_ms", "graph_pct_of_best_peer")):
        peers = [results[p][key] for p in GEMM_PEERS if results[p].get(key)]
        for ours in ("triton_grouped", "triton_loop", "triton_loop_gemm_only"):
            if peers and results[ours].get(key):
                results[ours][out] = 100 * min(peers) / results[ours][key]


# -- (2) the MoE layer --------------------------------------------------------------------------

@dataclasses.dataclass
class Layer:
    fn: object  # x [1,T,H] -> out [1,T,H]
    params: list  # the tensors it trains, whose gradients forward + backward computes
    backend: str
    ops: object = None  # ours: the ProfileOps, whose recorder says what ran


def grouped_mm_layer(x, router, gate_up, down, top_k: int, norm_topk_prob: bool):
    """A MoE layer on torch._grouped_mm, written as its users write it: route (fp32 softmax, top-k,
    renormalised), permute rows by expert, one grouped GEMM for gate+up and one for down, weight,
    unpermute, sum each token's k outputs."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    probs = torch.softmax(F.linear(flat, router).float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    offs = torch.cumsum(torch.bincount(flat_experts, minlength=router.shape[0]), 0, dtype=torch.int32)
    rows = flat[order // top_k]
    gate, up = torch._grouped_mm(rows, gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, down.transpose(-2, -1), offs=offs)
    y = y * weights.reshape(-1)[order, None]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return y[inverse].view(*shape[:-1], top_k, shape[-1]).sum(dim=-2)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A leaf sharing t's storage: every implementation trains the same weights without a copy."""
    return t.detach().requires_grad_()


def ours_layer(s: Shapes, weights) -> Layer:
    from rl_engine.models.config import MoeConfig
    from rl_engine.models.moe import local_experts, moe_block
    from rl_engine.models.profiles import ProfileOps, get_profile

    router, gate_up, down = weights
    ops = ProfileOps(get_profile("triton_bf16"))
    config = MoeConfig(num_experts=s.experts, top_k=s.top_k, expert_intermediate_size=s.inter, norm_topk_prob=True)
    # The stacks a model holds (rl_engine.models.weights): gate and up [E,I,H] each, down [E,H,I]
    # (gate and up copied once here, out of the timed calls, from transformers' fused gate_up).
    gate, up = _leaf(gate_up[:, :s.inter].clone()), _leaf(gate_up[:, s.inter:].clone())
    r, d = _leaf(router), _leaf(down)

    def fn(x):
        return moe_block(ops, "moe", x, r, config, local_experts(ops, "moe", gate, up, d))

    return Layer(fn, [r, gate, up, d], "", ops)


def ours_backend(layer: Layer) -> str:
    """What the profile dispatched (op -> backend, kernel), from its recorder; then the recorder is emptied."""
    records = layer.ops.recorder.records
    ran = sorted({f"{r.op}->{r.backend} ({r.target})" for r in records})
    records.clear()
    return "triton_bf16: " + "; ".join(ran)


def transformers_default_experts(tf) -> str:
    """The experts implementation a transformers Qwen3-MoE model picks when the user names none."""
    config = tf.Qwen3MoeConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=2,
                               num_experts_per_tok=1, moe_intermediate_size=16)
    model = tf.Qwen3MoeForCausalLM(config)
    return getattr(model.config, "_experts_implementation", None) or "eager"


def transformers_layer(tf, s: Shapes, weights, implementation: str | None) -> Layer:
    """Qwen3MoeSparseMoeBlock holding our weights; `implementation` sets config._experts_implementation
    (transformers >= 5); None for older transformers, whose block is a per-expert loop."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    router, gate_up, down = weights
    config = tf.Qwen3MoeConfig(hidden_size=s.hidden, num_experts=s.experts, num_experts_per_tok=s.top_k,
                               moe_intermediate_size=s.inter, norm_topk_prob=True, hidden_act="silu")
    if implementation is not None:
        config._experts_implementation = implementation
    with torch.device("meta"):  # no host allocation or init of weights that are replaced below
        block = Qwen3MoeSparseMoeBlock(config)
    P = torch.nn.Parameter
    block.gate.weight = P(router.detach())
    params = [block.gate.weight]  # in _stacked's order
    if hasattr(block.experts, "gate_up_proj"):  # transformers >= 5: experts as 3D tensors
        block.experts.gate_up_proj = P(gate_up.detach())
        block.experts.down_proj = P(down.detach())
        params += [block.experts.gate_up_proj, block.experts.down_proj]
    else:  # transformers 4: a ModuleList of gated MLPs
        for e, mlp in enumerate(block.experts):
            mlp.gate_proj.weight = P(gate_up[e, :s.inter].detach())
            mlp.up_proj.weight = P(gate_up[e, s.inter:].detach())
            mlp.down_proj.weight = P(down[e].detach())
            params += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    if len(params) != len(list(block.parameters())) or any(p.is_meta for p in block.parameters()):
        raise RuntimeError("transformers' block has a parameter this benchmark does not set")

    def fn(x):
        out = block(x)
        return out[0] if isinstance(out, tuple) else out  # transformers 4 also returns the router logits

    name = implementation or "eager (transformers < 5: per-expert loop)"
    return Layer(fn, params, f"transformers {tf.__version__}, experts_implementation={name}")


def layer_impls(s: Shapes, weights, grouped_status, names) -> dict:
    """name -> Layer, or an "unavailable: ..." string."""
    router, gate_up, down = weights
    impls = {}
    if "grouped_mm_layer" in names:
        r, gu, d = _leaf(router), _leaf(gate_up), _leaf(down)
        impls["grouped_mm_layer"] = grouped_status or Layer(
            lambda x: grouped_mm_layer(x, r, gu, d, s.top_k, True), [r, gu, d], "torch._grouped_mm")
    if "triton" in names:
        impls["triton"] = ours_layer(s, weights)
    tf = optional_import("transformers")
    wanted = [n for n in ("transformers", "transformers_eager") if n in names]
    if tf is None:
        impls.update(dict.fromkeys(wanted, "unavailable: transformers is not installed"))
        return impls
    default = transformers_default_experts(tf) if hasattr(tf.Qwen3MoeConfig(), "_experts_implementation") else None
    if "transformers" in wanted:
        impls["transformers"] = transformers_layer(tf, s, weights, default)
    if "transformers_eager" in wanted and default not in (None, "eager"):
        impls["transformers_eager"] = transformers_layer(tf, s, weights, "eager")
    return impls


def time_layer(layer: Layer, x, grad_out, timer: Timer) -> tuple[dict, torch.Tensor, list]:
    """{"fwd_ms", "fwd_bwd_ms", peaks}, the output, and the gradients [dx, router, gate_up, down]."""
    xg = x.detach().requires_grad_()
    wrt = [xg, *layer.params]

    def forward():
        with torch.no_grad():
            return layer.fn(x)

    def forward_backward():
        # allow_unused: an expert that no token chose is not in the graph (toy shapes).
        return torch.autograd.grad(layer.fn(xg), wrt, grad_out, allow_unused=True)

    fwd_ms, out = timer.timed(forward)
    fwd_bwd_ms, grads = timer.timed(forward_backward)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wrt, grads)]
    row = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fwd_bwd_ms,
           "fwd_peak_mb": timer.peak_mb(forward), "fwd_bwd_peak_mb": timer.peak_mb(forward_backward)}
    if row["fwd_bwd_peak_mb"] is not None:  # minus the gradients every implementation returns
        row["fwd_bwd_work_mb"] = row["fwd_bwd_peak_mb"] - sum(t.numel() * t.element_size() for t in wrt) / 1e6
    return row, out, [grads[0], *_stacked(grads[1:])]


def _stacked(grads: list) -> list:
    """[router, gate_up [E,2I,H], down [E,H,I]] from a Layer's parameter order: those three, the router
    then the gate, up and down stacks (ours), or the router then (gate, up, down) per expert."""
    if len(grads) == 3:
        return grads
    if len(grads) == 4:
        return [grads[0], torch.cat(grads[1:3], dim=1), grads[3]]
    experts = grads[1:]
    gate_up = torch.stack([torch.cat(experts[i:i + 2]) for i in range(0, len(experts), 3)])
    return [grads[0], gate_up, torch.stack(experts[2::3])]


GRAD_NAMES = ("dx", "drouter", "dgate_up", "ddown")
PROFILED = ("triton", "grouped_mm_layer")  # where a layer's forward + backward time goes, kernel by kernel


def top_kernels(layer: Layer, x, grad_out, device: str, count: int = 12) -> tuple[list[dict], float]:
    """The kernels (CUDA; on the CPU, its ops) that take the most time in one forward + backward, after a
    warm-up call: [{"name", "ms", "calls"}], by total time, and all of them summed (ms)."""
    from torch.profiler import ProfilerActivity, profile

    xg = x.detach().requires_grad_()
    step = lambda: torch.autograd.grad(layer.fn(xg), [xg, *layer.params], grad_out, allow_unused=True)  # noqa: E731
    step()
    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    events = prof.key_averages()
    total = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    rows = sorted((e for e in events if total(e) > 0), key=total, reverse=True)
    top = [{"name": e.key[:80], "ms": total(e) / 1e3, "calls": e.count} for e in rows[:count]]
    return top, sum(total(e) for e in rows) / 1e3


def _diffs(out, grads, ref) -> dict:
    """max |impl - reference| of the output and of each gradient (with the reference's max |.| as its
    scale), and the relative L2 error."""
    row = {}
    for name, value, r in zip(("out", *GRAD_NAMES), (out, *grads), (ref[0], *ref[1])):
        row[f"{name}_max_diff"] = _max_abs_diff(value, r)
        row[f"{name}_max_abs"] = r.float().abs().max().item()
        row[f"{name}_rel_l2"] = _rel_l2(value, r)
    return row


def _top_kernels_row(layer, x, grad_out, device) -> dict:
    top, summed = top_kernels(layer, x, grad_out, device)
    return {"top": top, "gpu_ms": summed}


def layer_section(s: Shapes, token_list, weights, timer: Timer, device: str, grouped_status,
                  names=LAYER_IMPLS) -> list[dict]:
    """One row per (tokens, impl). Diffs are against the first implementation that ran (grouped_mm_layer
    unless it is unavailable), named in each row's diff_reference."""
    impls = measure("build the MoE layers", lambda: {"impls": layer_impls(s, weights, grouped_status, names)})
    if "error" in impls:
        return [{"tokens": t, "impl": n, "error": impls["error"]} for t in token_list for n in names]
    impls = impls["impls"]
    rows = []
    for tokens in token_list:
        gen = torch.Generator(device=device).manual_seed(tokens)
        x = torch.randn(1, tokens, s.hidden, generator=gen, device=device, dtype=DTYPE)
        grad_out = torch.randn(1, tokens, s.hidden, generator=gen, device=device, dtype=DTYPE)
        results, ref, ref_name = {}, None, None
        for name, layer in impls.items():
            if isinstance(layer, str):
                results[name] = {"error": layer}
                continue
            got = measure(f"MoE layer tokens={tokens} {name}", time_layer, layer, x, grad_out, timer)
            if isinstance(got, dict):  # measure's {"error": ...}
                results[name] = got
                continue
            row, out, grads = got
            row["backend"] = ours_backend(layer) if layer.ops is not None else layer.backend
            if name in PROFILED:
                kernels = measure(f"  kernels of {name}", _top_kernels_row, layer, x, grad_out, device)
                row["top_kernels"] = kernels.get("top", kernels.get("error"))
                if device == "cuda" and "gpu_ms" in kernels:
                    row["gpu_fwd_bwd_ms"] = kernels["gpu_ms"]
            if ref is None:
                ref, ref_name = (out, grads), name
            row.update(diff_reference=ref_name, **_diffs(out, grads, ref))
            results[name] = row
            del out, grads, got
        base = results.get("grouped_mm_layer", {})
        for row in results.values():
            for key in ("fwd_ms", "fwd_bwd_ms", "fwd_bwd_peak_mb"):
                if row.get(key) and base.get(key):
                    row[f"{key.removesuffix('_ms').removesuffix('_mb')}_x_grouped_mm"] = row[key] / base[key]
            if row.get("gpu_fwd_bwd_ms") and base.get("gpu_fwd_bwd_ms"):
                row["gpu_x_grouped_mm"] = row["gpu_fwd_bwd_ms"] / base["gpu_fwd_bwd_ms"]
        rows += [{"tokens": tokens, "impl": name, **row} for name, row in results.items()]
        del x, grad_out, ref
    del impls
    return rows


# -- the run ------------------------------------------------------------------------------------

GEMM_COLUMNS = ["gemm", "tokens", "rows", "impl", "ms", "tflop_per_s", "pct_of_best_peer", "pct_of_dense_ref",
                "graph_ms", "graph_tflop_per_s", "graph_pct_of_best_peer", "max_abs_diff", "bitwise_vs_triton_loop",
                "error"]
LAYER_COLUMNS = ["tokens", "impl", "fwd_ms", "fwd_bwd_ms", "fwd_bwd_x_grouped_mm", "gpu_fwd_bwd_ms", "gpu_x_grouped_mm",
                 "fwd_peak_mb", "fwd_bwd_peak_mb",
                 "fwd_bwd_peak_x_grouped_mm", "out_rel_l2", "dx_rel_l2", "drouter_rel_l2", "dgate_up_rel_l2",
                 "ddown_rel_l2", "error"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help="comma-separated token counts (default: 4096,16384,65536; --quick: 4096)")
    parser.add_argument("--gemm-only", action="store_true", help="time the grouped GEMM section only (1)")
    args = parser.parse_args(argv)
    if args.tokens is not None:
        try:
            args.tokens = tuple(int(t) for t in args.tokens.split(","))
        except ValueError:
            parser.error(f"--tokens: expected comma-separated integers, got {args.tokens!r}")
        if min(args.tokens) <= 0:
            parser.error("--tokens: token counts must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: needs CUDA; the benchmarks run on the GPU machine\n")
    return args


def _series(rows, key, names, token_list, **match):
    return {n: [next((r.get(key) for r in rows if r["impl"] == n and r["tokens"] == t
                      and all(r.get(k) == v for k, v in match.items())), None) for t in token_list] for n in names}


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "cpu":
        # Read when a kernel module is imported: rl_engine's kernels are imported only after this line.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    s = QWEN3_30B_A3B if device == "cuda" else TOY
    token_list = args.tokens or (s.quick_tokens if args.quick else s.tokens)
    timer = Timer(device, args.quick)
    grouped_status = grouped_mm_unavailable(device)
    print(f"shapes {dataclasses.asdict(s)}, tokens {list(token_list)}, device {device}; "
          f"torch._grouped_mm: {grouped_status or grouped_mm_path(device)}", flush=True)
    gemm = measure("bf16 GEMM 8192^3", gemm_ceiling) if device == "cuda" else {"error": "not measured on cpu"}
    print(f"ceiling: bf16 GEMM {gemm.get('tflop_per_s', float('nan')):.0f} TFLOP/s", flush=True)

    weights = make_weights(s, device)
    print("(1) grouped GEMM alone", flush=True)
    gemm_rows, configs = gemm_section(s, token_list, weights, timer, device, grouped_status)
    layer_rows = []
    if not args.gemm_only:
        print("(2) MoE layer forward, forward + backward", flush=True)
        layer_rows = layer_section(s, token_list, weights, timer, device, grouped_status)
    del weights
    if device == "cuda":
        torch.cuda.empty_cache()

    print_table(gemm_rows, GEMM_COLUMNS)
    print_table(layer_rows, LAYER_COLUMNS)
    for row in layer_rows:
        if isinstance(row.get("top_kernels"), list):
            print(f"\ntokens={row['tokens']} {row['impl']}: where forward + backward spends its time")
            print_table(row["top_kernels"], ["name", "ms", "calls"])
    write_json(args.out, "moe", {
        "device": device, "dtype": "bfloat16", "shapes": dataclasses.asdict(s), "tokens": list(token_list),
        "ceilings": {"gemm_8192": gemm},
        "flop_model": "grouped GEMM: 2*rows*N*K, rows = tokens*top_k",
        "grouped_mm": grouped_status or grouped_mm_path(device),
        "triton_matmul_config": configs, "gemm_rows": gemm_rows, "layer_rows": layer_rows,
        "goals": {"grouped_gemm_pct_of_best_peer": ">= 85", "layer_x_grouped_mm": "<= 1.2 (ms and peak memory)"},
    })
    gemm_names = [n for n in GEMM_IMPLS if n != "cublas_dense_ref"]
    layer_names = sorted({r["impl"] for r in layer_rows}, key=LAYER_IMPLS.index)
    save_plot(args.out, "moe", [
        *({"title": f"grouped GEMM {g}, bf16", "xlabel": "tokens (rows = tokens x top-k)", "ylabel": "TFLOP/s",
           "x": list(token_list), "series": _series(gemm_rows, "tflop_per_s", gemm_names + ["cublas_dense_ref"],
                                                    token_list, gemm=g)} for g in ("gate_up", "down")),
        {"title": "MoE layer forward + backward: time", "xlabel": "tokens", "ylabel": "ms / grouped_mm_layer ms",
         "x": list(token_list), "series": _series(layer_rows, "fwd_bwd_x_grouped_mm", layer_names, token_list),
         "logy": True, "hline": (1.2, "goal 1.2x")},
        {"title": "MoE layer forward + backward: peak memory", "xlabel": "tokens",
         "ylabel": "peak / grouped_mm_layer peak", "x": list(token_list), "hline": (1.2, "goal 1.2x"),
         "series": _series(layer_rows, "fwd_bwd_peak_x_grouped_mm", layer_names, token_list)},
    ])
    return 0


if __name__ == "__main__":
    sys.exit(main())
