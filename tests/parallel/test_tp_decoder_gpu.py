"""The tensor-parallel decoder on NCCL at Qwen3 vocabulary and head shapes: as many ranks as the GPUs allow
(1, 2 or 4), each TP size bitwise equal to the single-GPU `triton_bf16` DecoderModel (logprobs, input and
weight gradients). Needs CUDA."""

from __future__ import annotations

import pytest
import torch
from tp_decoder_cases import GPU_CONFIG, decoder_run, op_run, run_ranks

from rl_engine.bits import bitwise_equal
from rl_engine.models.decoder import DecoderModel
from rl_engine.models.profiles import ProfileOps, get_profile
from rl_engine.models.weights import synthetic_weights
from rl_engine.parallel.launch import spawn_group


@pytest.mark.gpu
def test_nccl_tp_decoder_equals_the_single_gpu_model_bitwise():
    gpus = torch.cuda.device_count()
    launch = 4 if gpus >= 4 else 2 if gpus >= 2 else 1
    tp_sizes = tuple(s for s in (1, 2, 4) if s <= launch)
    ranks = spawn_group(run_ranks, launch, backend="nccl", device="cuda", args=(tp_sizes, GPU_CONFIG))
    model = DecoderModel(GPU_CONFIG, synthetic_weights(GPU_CONFIG, 3, device="cuda"),
                         ProfileOps(get_profile("triton_bf16")))
    single = {f"decoder_{rows}.{k}": v.cpu() for rows in (3, 1) for k, v in decoder_run(model, rows).items()}
    single.update({k: v.cpu() for k, v in op_run(None, "cuda").items()})
    for tp in map(str, tp_sizes):
        for rank, results in enumerate(ranks):
            bad = sorted(k for k, v in single.items() if not bitwise_equal(results[tp][k], v))
            assert bad == [], (tp, rank, bad)
            assert results[f"weight_grad_mismatches_{tp}"] == [], (tp, rank)  # against a single model on its GPU
    assert bitwise_equal(single["decoder_1.logp"], single["decoder_3.logp"][:1])
