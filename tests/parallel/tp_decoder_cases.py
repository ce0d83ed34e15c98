"""What the ranks run for tests/parallel/test_tp_decoder.py (spawned ranks import this module by name).

Tiny dense Qwen3 shapes under the Triton interpreter (BLOCK_K 16, linear_logp's chunk 32): every split
reduction holds whole K steps at TP = 4 (o_proj K 64, down_proj K 128, q/k/v output rows 64).
"""

from __future__ import annotations

import interpreter_memos
import torch
import torch.distributed as dist

from rl_engine.kernels.ops.triton.linear.matmul import batch_invariant_mm
from rl_engine.models.config import ModelConfig
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import synthetic_weights
from rl_engine.parallel import tp_kernels
from rl_engine.parallel.tp_decoder import TensorParallelDecoder, weight_part
from rl_engine.parallel.tp_kernels import Ranks, vocab_align, vocab_bounds

interpreter_memos.install()  # spawned ranks import this module, not conftest (tests/interpreter_memos.py)

CONFIG = ModelConfig("tp_tiny", "qwen3", 128, 64, 128, 1, 4, 4, 16)
# On the GPU (NCCL): Qwen3's vocabulary and head shape, K of o_proj 2048 and of down_proj 3072.
GPU_CONFIG = ModelConfig("tp_gpu", "qwen3", 151936, 1024, 3072, 2, 16, 8, 128)
SEQ = 3


def batch(rows: int, vocab: int, device="cpu"):
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (3, SEQ + 1), generator=gen)[:rows].to(device)
    grad = torch.randn(3, SEQ, generator=gen)[:rows].to(device)
    return ids[:, :SEQ], ids[:, 1:], grad


def decoder_run(model, rows: int, weight_grads: bool = False) -> dict:
    """Selected logprobs and the gradient of sum(g * logp) with respect to the input embeddings (and, if
    asked, every weight's gradient, the embedding's too, from the same backward)."""
    device = model.lm_head_weight.device
    config = getattr(model, "full_config", model.config)
    ids, targets, grad = batch(rows, config.vocab_size, device)
    weights = [t for t in model.w.values() if t.is_floating_point()]
    for t in weights:
        t.requires_grad_(weight_grads)
    embeds = model.embed(ids)
    if weight_grads:
        embeds.retain_grad()
    else:
        embeds = embeds.detach().requires_grad_()
    positions = torch.arange(SEQ, device=device).expand(rows, SEQ)
    logp = model.selected_logprobs(model.forward(None, positions, embeds=embeds), targets)
    (logp * grad).sum().backward()
    out = {"logp": logp.detach(), "grad_embeds": embeds.grad, "embeds": embeds.detach()}
    if weight_grads:
        out["weight_grads"] = {n: t.grad for n, t in model.w.items() if t.grad is not None}
        for t in weights:
            t.requires_grad_(False)
            t.grad = None
    return out


def fresh(weights: dict) -> dict:
    return {n: t.detach().clone() for n, t in weights.items()}  # tensors of their own to hold gradients


def single_run(config, weights) -> dict:
    """The single-process `triton_bf16` DecoderModel (not the TP class) at 3 rows, with weight gradients,
    and at 1 row."""
    model = DecoderModel(config, fresh(weights), ProfileOps(get_profile("triton_bf16")))
    out = {f"decoder_{rows}.{k}": v for rows in (3, 1) for k, v in decoder_run(model, rows, rows == 3).items()}
    grads = out.pop("decoder_3.weight_grads")
    assert len(grads) == len(weights) and all(g.abs().max() > 0 for g in grads.values()), "vacuous gradients"
    return out, grads


def tp_run(config, weights, group) -> dict:
    """The TP decoder at 3 rows (with weight gradients) and 1 row; "weight_grads": name -> (this rank's
    gradient, its index into the whole weight's gradient; None: replicated)."""
    model = TensorParallelDecoder(config, fresh(weights), group)
    out = {f"decoder_{rows}.{k}": v for rows in (3, 1) for k, v in decoder_run(model, rows, rows == 3).items()}
    part = weight_part(config, group)
    out["weight_grads"] = {n: (g, part(n, tuple(weights[n].shape)))
                           for n, g in out.pop("decoder_3.weight_grads").items()}
    return out


def weight_grad_mismatches(tp: dict, single: dict) -> list:
    """The weights whose gradient slice on this rank differs from the single-process model's (bitwise)."""
    return [n for n, g in single.items() if n not in tp or not torch.equal(
        tp[n][0], g if tp[n][1] is None else g[tp[n][1]])]


def _split(t: torch.Tensor, dim: int, ranks: Ranks) -> torch.Tensor:
    part = ranks.even_split("t", t.shape[dim])
    return t[(slice(None),) * dim + (part,)].contiguous()


def _gather(t: torch.Tensor, dim: int, ranks: Ranks) -> torch.Tensor:
    if ranks.group is None:
        return t
    parts = [torch.empty_like(t) for _ in range(ranks.size)]
    dist.all_gather(parts, t.contiguous(), group=ranks.group)
    return torch.cat(parts, dim)


def op_run(group, device="cpu") -> dict:
    """The split ops alone, on bf16 data: outputs and input gradients, gathered where local."""
    ranks = Ranks(group)
    # Whole K steps per rank at TP = 4 (interpreter BLOCK_K 16, GPU 64), vocabulary runs of whole chunks.
    k, n_col, vocab = (64, 64, 128) if device == "cpu" else (256, 256, 4 * 4096)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(7, k, generator=gen).bfloat16().to(device)
    w_row = (torch.randn(48, k, generator=gen) / 8).bfloat16().to(device)
    w_col = (torch.randn(n_col, k, generator=gen) / 8).bfloat16().to(device)
    lm = (torch.randn(vocab, k, generator=gen) / 8).bfloat16().to(device)
    targets = torch.randint(0, vocab, (1, 7), generator=gen).to(device)
    out = {}
    xr = _split(x, 1, ranks).requires_grad_()
    y = tp_kernels.row_parallel_matmul(xr, _split(w_row, 1, ranks), group)
    y.float().square().sum().backward()
    out["row_parallel.forward"], out["row_parallel.grad_x"] = y.detach(), _gather(xr.grad, 1, ranks)
    xc = x.clone().requires_grad_()
    y = tp_kernels.column_parallel_matmul(xc, _split(w_col, 0, ranks), group)
    y.float().square().sum().backward()
    out["column_parallel.forward"], out["column_parallel.grad_x"] = _gather(y.detach(), 1, ranks), xc.grad
    out["row_parallel_fp32.forward"] = row_parallel_fp32(group, device)
    bounds = vocab_bounds(vocab, ranks.size, vocab_align(lm.dtype))
    h = x[None].clone().requires_grad_()
    lm_local = lm[bounds[ranks.rank]:bounds[ranks.rank + 1]].contiguous()
    logp = tp_kernels.vocab_parallel_linear_logp(h, lm_local, targets, group, vocab)
    logp.backward(torch.linspace(-1, 1, 7, device=device)[None])
    out["linear_logp.forward"], out["linear_logp.grad_hidden"] = logp.detach(), h.grad
    out["embedding"] = tp_kernels.vocab_parallel_embedding(targets, lm_local, group, vocab)
    return out


def row_parallel_fp32(group, device="cpu") -> torch.Tensor:
    """fp32 in and out (no rounding to hide an order change): the planted bug's correct twin."""
    ranks = Ranks(group)
    gen = torch.Generator().manual_seed(6)
    x, w = torch.randn(64, 256, generator=gen).to(device), (torch.randn(32, 256, generator=gen) / 16).to(device)
    return tp_kernels.row_parallel_matmul(_split(x, 1, ranks), _split(w, 1, ranks), group)


def allreduce_continued_mm(a, b, k_full, ranks):
    """Planted bug: each rank's part from zero, summed by all_reduce (the backend's order)."""
    own = batch_invariant_mm(a, b, out_fp32=True)
    if ranks.group is not None:
        dist.all_reduce(own, group=ranks.group)
    return own.to(a.dtype)


def run_ranks(rank: int, world_size: int, device: str, tp_sizes=(1, 2, 4), config=CONFIG) -> dict:
    """spawn_group entry: per TP size, every rank's op results and decoder results at 3 rows (with weight
    gradients) and 1 row."""
    if device == "cpu":
        tp_kernels.PIPELINE_ROWS = 4  # several hand-offs per reduction at these few rows (7 and 15)
    weights = synthetic_weights(config, 3, device=device)
    results = {}
    for tp in tp_sizes:
        groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world_size // tp)]
        group = groups[rank // tp]
        if device == "cpu" and rank >= tp:  # the other groups would repeat the first one's work
            continue
        results[str(tp)] = {**op_run(group, device), **tp_run(config, weights, group)}
    if device != "cpu":  # on the CPU the parent computes the reference once
        _, single = single_run(config, weights)
        for tp in tp_sizes:
            results[f"weight_grad_mismatches_{tp}"] = weight_grad_mismatches(results[str(tp)].pop("weight_grads"),
                                                                             single)
    if world_size < 2:
        return results
    original = tp_kernels._continued_mm
    tp_kernels._continued_mm = allreduce_continued_mm
    try:
        group = dist.new_group(list(range(world_size)))
        results["planted_allreduce"] = row_parallel_fp32(group, device)
    finally:
        tp_kernels._continued_mm = original
    return results


def checkpoint_run(rank: int, world_size: int, device: str, path: str, config=CONFIG) -> dict:
    """spawn_group entry: the decoder built from this rank's slices of a checkpoint directory."""
    group = dist.new_group(list(range(world_size)))
    model = TensorParallelDecoder.from_checkpoint(path, config, group, device=device)
    shapes = {n: torch.tensor(t.shape) for n, t in model.w.items()}
    return {**{f"decoder_3.{k}": v for k, v in decoder_run(model, 3).items()}, **{f"shape.{n}": s for n, s in
                                                                                    shapes.items()}}


def families_run(rank: int, world_size: int, device: str, names=("tiny-qwen2", "tiny-llama")) -> dict:
    """spawn_group entry: Qwen2.5 (q/k/v biases) and Llama 3 (rope scaling, tied head) tiny configs at TP = 2."""
    from rl_engine.models.families import get_config

    group = dist.new_group(list(range(world_size)))
    out = {}
    for name in names:
        config = get_config(name).with_layers(1)  # one layer holds every family difference
        model = TensorParallelDecoder(config, synthetic_weights(config, 3, device=device), group)
        out.update({f"{name}.{k}": v for k, v in decoder_run(model, 3).items()})
    return out
