"""The experimental Gluon attention forward (attention/gluon_forward.py): its input checks, its sm_90a
compile on the CPU, and on the H200 the bits of flash.py's forward. Gluon's API moves between Triton
releases; the module is written for the H200's Triton 3.6."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton

pytestmark = pytest.mark.skipif(not triton.__version__.startswith("3.6."),
                                reason=f"Gluon kernel written for Triton 3.6, this is {triton.__version__}")

COMPILE = """
import json, re, sys
from rl_engine.kernels.ops.triton.attention.gluon_forward import compile_for_sm90
k = compile_for_sm90(causal=sys.argv[1] == "causal")
ptx = k.asm["ptx"]
print(json.dumps({"shared": k.metadata.shared, "warps": k.metadata.num_warps, "cubin": len(k.asm["cubin"]),
                  "wgmma": ptx.count("wgmma.mma_async"), "target": re.findall(r"^\\.target (\\S+)", ptx, re.M)}))
"""


def _bf16(*shape, seed=0, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=device).to(torch.bfloat16)


@pytest.mark.parametrize("bad, message", [
    (dict(dtype=torch.float16), "contiguous bf16"),
    (dict(d=64), "head_dim 128"),
    (dict(s=100), "multiple of 192"),
    (dict(s=2304), "one KV split"),
    (dict(hkv=3), "multiple of Hkv"),
])
def test_inputs_it_does_not_cover_are_refused(bad, message):
    from rl_engine.kernels.ops.triton.attention.gluon_forward import check_inputs

    s, d, hkv = bad.get("s", 192), bad.get("d", 128), bad.get("hkv", 2)
    q = torch.zeros(1, s, 4, d, dtype=bad.get("dtype", torch.bfloat16))
    k = torch.zeros(1, s, hkv, d, dtype=q.dtype)
    with pytest.raises(ValueError, match=message):
        check_inputs(q, k, k.clone(), kv_split=2048)


@pytest.mark.parametrize("mask", ["causal", "full"])
def test_compiles_for_the_h200(mask):
    from rl_engine.kernels.ops.triton.sm90 import H200_SHARED_BYTES

    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", COMPILE, mask], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["target"] == ["sm_90a"] and result["cubin"] > 0
    assert result["wgmma"] > 0 and result["shared"] <= H200_SHARED_BYTES
    assert result["warps"] == 16, "three consumer warpgroups and a producer warp rounded up to a warpgroup"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("b, s, hq, hkv", [(2, 1536, 32, 8), (1, 192, 4, 4), (3, 576, 8, 2)])
def test_gpu_gives_the_bits_of_the_triton_forward(causal, b, s, hq, hkv):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is written for Hopper (sm_90a)")
    from rl_engine.kernels.ops.triton.attention.attention import triton_attention
    from rl_engine.kernels.ops.triton.attention.gluon_forward import gluon_flash_forward

    q, k, v = (_bf16(b, s, h, 128, seed=i, device="cuda") for i, h in enumerate((hq, hkv, hkv)))
    got = gluon_flash_forward(q, k, v, causal=causal)
    want = triton_attention(q, k, v, causal=causal)
    assert torch.equal(got, want), f"{(got != want).float().mean().item():.2e} of the outputs differ"
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=causal, enable_gqa=True).transpose(1, 2)
    assert (got.float() - ref).abs().max().item() < 2e-2
