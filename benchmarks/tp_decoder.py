"""The tensor-parallel decoder on NCCL against the single-GPU model (issue 20): same bits, and the time of both.

    python benchmarks/tp_decoder.py --out DIR [--quick] [--tp 2] [--layers 4] [--rows 4] [--seq 1024]

Qwen3-8B width (hidden 4096, 32/8 heads x 128, intermediate 12288, vocabulary 151936, untied), the first
--layers layers, synthetic bf16 weights drawn on the GPU (every rank draws the same full weights and keeps
its slice). A step is: embed, forward, selected logprobs, backward of sum(g * logp) to the input embeddings
(the TP decoder's gradient path; weight gradients are not part of it). Each of the --tp ranks runs the
TensorParallelDecoder; then the parent runs `DecoderModel(triton_bf16)` on GPU 0. Compared bitwise:
per-token logprobs and the embeddings' gradient, at --rows rows and at 1 row (a different token count
on the same TP size). Times: median of CUDA-event timed steps after warm-up, per rank and single.
"""

from __future__ import annotations

import statistics
import time

import torch
from common import arg_parser, parse_gpu_args, print_table, write_json

from rl_engine.bits import bitwise_equal
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.families import get_config
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import synthetic_weights
from rl_engine.parallel.launch import spawn_group
from rl_engine.parallel.tp_decoder import TensorParallelDecoder

DEVICE = "cuda"  # tests/benchmarks/test_tp_decoder_smoke.py runs it on gloo at the tiny config


def inputs(config, rows: int, seq: int, device):
    gen = torch.Generator().manual_seed(17)
    ids = torch.randint(0, config.vocab_size, (rows, seq + 1), generator=gen)
    grad = torch.randn(rows, seq, generator=gen)
    return ids[:, :seq].to(device), ids[:, 1:].to(device), grad.to(device)


def step(model, ids, targets, grad, vocab_embed):
    embeds = vocab_embed(ids).detach().requires_grad_()
    rows, seq = ids.shape
    positions = torch.arange(seq, device=ids.device).expand(rows, seq)
    logp = model.selected_logprobs(model.forward(None, positions, embeds=embeds), targets)
    (logp * grad).sum().backward()
    return logp.detach(), embeds.grad


def timed_steps(model, config, rows, seq, reps: int) -> dict:
    """Results at `rows` and at 1 row, and the median step time at `rows` (ms; wall time on the CPU)."""
    device = model.lm_head_weight.device
    ids, targets, grad = inputs(config, rows, seq, device)
    out = {}
    logp, g = step(model, ids, targets, grad, model.embed)
    out["logp"], out["grad_embeds"] = logp, g
    logp1, g1 = step(model, ids[:1], targets[:1], grad[:1], model.embed)
    out["logp_1row"], out["grad_embeds_1row"] = logp1, g1
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(model, ids, targets, grad, model.embed)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step(model, ids, targets, grad, model.embed)
            times.append((time.perf_counter() - t0) * 1e3)
    out["step_ms"] = torch.tensor(statistics.median(times))
    return out


def tp_rank(rank: int, world_size: int, device: str, config, rows, seq, reps) -> dict:
    weights = synthetic_weights(config, 3, device=device)
    model = TensorParallelDecoder(config, weights, torch.distributed.group.WORLD)
    del weights
    return timed_steps(model, config, rows, seq, reps)


def run(config, tp: int, rows: int, seq: int, reps: int, backend: str, device: str) -> dict:
    ranks = spawn_group(tp_rank, tp, backend=backend, device=device, args=(config, rows, seq, reps))
    model = DecoderModel(config, synthetic_weights(config, 3, device=device), ProfileOps(get_profile("triton_bf16")))
    single = {k: v.cpu() for k, v in timed_steps(model, config, rows, seq, reps).items()}
    del model
    keys = ("logp", "grad_embeds", "logp_1row", "grad_embeds_1row")
    bitwise = {k: all(bitwise_equal(r[k], single[k]) for r in ranks) for k in keys}
    bitwise["1row_is_row0"] = bitwise_equal(single["logp_1row"], single["logp"][:1])
    tp_ms = [float(r["step_ms"]) for r in ranks]
    return {"config": config.name, "layers": config.num_layers, "tp": tp, "rows": rows, "seq": seq,
            "tokens": rows * seq, "single_ms": float(single["step_ms"]), "tp_rank_ms": tp_ms,
            "tp_over_single": max(tp_ms) / float(single["step_ms"]), "bitwise": bitwise,
            "passed": all(bitwise.values())}


def main() -> int:
    parser = arg_parser(__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    args = parse_gpu_args(parser)
    if torch.cuda.device_count() < args.tp:
        parser.exit(2, f"{parser.prog}: error: --tp {args.tp} needs {args.tp} GPUs, "
                       f"{torch.cuda.device_count()} visible\n")
    config = get_config("qwen3-8b").with_layers(args.layers)
    row = run(config, args.tp, args.rows, args.seq, 3 if args.quick else 10, "nccl", DEVICE)
    print_table([{**row, "bitwise": all(row["bitwise"].values())}],
                ["config", "layers", "tp", "tokens", "single_ms", "tp_rank_ms", "tp_over_single", "bitwise"])
    write_json(args.out, "tp_decoder", {"rows": [row]})
    return 0 if row["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
