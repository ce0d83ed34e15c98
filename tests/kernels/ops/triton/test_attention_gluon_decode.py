"""The Gluon decode (attention/gluon_decode.py): what it routes, its sm_90a compile on the CPU without ptxas serialising
its wgmma (C7514/C7515, which made its first form 1.37x slower than flash.py's), and on the H200 flash.py's bits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import triton
from one_compile_process import case_result, compile_selected

from rl_engine.kernels.ops.triton.attention import gluon_compat

pytestmark = pytest.mark.skipif(not gluon_compat.supported(),
                                reason=f"Gluon kernels written for Triton {gluon_compat.SUPPORTED}, this is "
                                       f"{triton.__version__}")

COMPILE = """
from rl_engine.kernels.ops.triton.attention.gluon_decode import compile_for_sm90
from rl_engine.kernels.ops.triton.sm90 import ptxas_registers
def compile_case(head_dim, mode, parts, seq, qn, page):
    k = compile_for_sm90(head_dim, mode == "partial", parts, seq == "lengths", qn, page or None)
    ptx = k.asm["ptx"]
    return {"shared": k.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"), **ptxas_registers(ptx)}
"""


@pytest.fixture(scope="module")
def compiles(request):
    """Every selected case of test_compiles_for_the_h200_without_serialised_wgmma, compiled in one process."""
    return compile_selected(request, "test_compiles_for_the_h200_without_serialised_wgmma", COMPILE,
                            lambda p: (p["head_dim"], p["mode"], p["parts"], p["seq"], p["qn"], p["page"]))


# page: a paged cache read through its block table (16-key pages: four copies a block)
@pytest.mark.parametrize("head_dim, mode, parts, seq, qn, page", [
    (128, "final", 2, "table", 8, 0), (128, "partial", 1, "table", 16, 0), (128, "partial", 2, "lengths", 8, 0),
    (128, "partial", 2, "lengths", 16, 0), (64, "final", 1, "lengths", 8, 0), (64, "partial", 1, "table", 16, 0),
    (128, "partial", 2, "lengths", 8, 16)])
def test_compiles_for_the_h200_without_serialised_wgmma(compiles, head_dim, mode, parts, seq, qn, page):
    from rl_engine.kernels.ops.triton.sm90 import H200_SHARED_BYTES

    result = case_result(compiles, (head_dim, mode, parts, seq, qn, page))
    assert result["wgmma"] > 0 and 0 < result["shared"] <= H200_SHARED_BYTES, result
    assert result["serialised_wgmma"] is None, f"ptxas serialises the wgmma: {result['serialised_wgmma']}"
    assert result["spill_bytes"] == 0, result


def test_routes_bf16_groups_of_up_to_16_query_columns():
    from rl_engine.kernels.ops.triton.attention import gluon_decode

    assert gluon_decode.head_dim_parts(128, 32) == 2 and gluon_decode.head_dim_parts(128, 66) == 1
    assert gluon_decode.head_dim_parts(64, 8) == 1
    assert gluon_decode.query_columns(4, 1) == 8 and gluon_decode.query_columns(8, 1) == 8  # Qwen3-8B / 32B decode
    assert gluon_decode.query_columns(4, 3) == 16 and gluon_decode.query_columns(16, 1) == 16
    q, k = torch.zeros(4, 32, 128, dtype=torch.bfloat16), torch.zeros(4, 8, 128, dtype=torch.bfloat16)
    assert not gluon_decode.covers(q, k, 1)  # CPU rows
    if torch.cuda.is_available():
        q, k = q.cuda(), k.cuda()
        hopper = torch.cuda.get_device_capability() == (9, 0)
        assert gluon_decode.covers(q, k, 1) == hopper and gluon_decode.covers(q, k, 4) == hopper
        assert not gluon_decode.covers(q, k, 5)  # 4 heads x 5 queries > 16 columns
        assert not gluon_decode.covers(q.half(), k.half(), 1)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, parts, sq", [(64, None, 1), (64, 1, 3), (128, None, 1), (128, 1, 1), (128, 2, 1),
                                                 (128, None, 3)])  # 64 rows: one part; 4 heads x 1 query: 8 columns
def test_gpu_gives_the_bits_of_flash_tiles_and_of_the_prefill(monkeypatch, head_dim, parts, sq):
    """The KV-cache step (lengths read in the kernel), the same rows through flash_forward's table, flash.py's tiles
    and the prefill: equal bits, over lengths that leave a split 1-5 blocks (the walk's odd and even tails), at 8
    query columns (one query per step) and 16 (three)."""
    from rl_engine.kernels.ops.triton.attention import gluon_decode, triton_attention, triton_kv_cache_attention
    from rl_engine.kernels.ops.triton.attention.contract import default_scale
    from rl_engine.kernels.ops.triton.attention.dispatch import flash_forward
    from rl_engine.kernels.ops.triton.attention.kv_cache_attention import kv_cache_table

    monkeypatch.setattr(gluon_decode, "PARTS", parts)
    lengths = [sq, 64, 65, 129, 193, 2048, 2049, 2200, 2250, 4097, 5000]
    gen = torch.Generator().manual_seed(head_dim)
    seqs = [tuple(torch.randn(n, h, head_dim, generator=gen).to(torch.bfloat16).cuda() for h in (32, 8, 8))
            for n in lengths]
    smax = max(lengths) + 5
    caches = []
    for i in (1, 2):  # NaN past every length: never read
        c = torch.full((len(seqs), smax, 8, head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        for b, s in enumerate(seqs):
            c[b, :len(s[i])] = s[i]
        caches.append(c)
    q = torch.stack([s[0][-sq:] for s in seqs])
    lengths_t = torch.tensor(lengths, device="cuda")
    calls = []
    launch = gluon_decode._launch
    monkeypatch.setattr(gluon_decode, "_launch", lambda *a, **kw: calls.append(a[-1]) or launch(*a, **kw))
    got = triton_kv_cache_attention(q, *caches, lengths_t)
    rows = [t.reshape(-1, 8 if t is not q else 32, head_dim) for t in (q, *caches)]
    table = kv_cache_table(lengths_t, sq, smax, "cuda")
    via_table, _ = flash_forward(*rows, table, causal=True, scale=default_scale(head_dim, None))
    assert calls == [True, False], "the step and the table's forward did not both take the Gluon decode"
    with monkeypatch.context() as m:
        m.setattr(gluon_decode, "covers", lambda *args: False)
        tiles = triton_kv_cache_attention(q, *caches, lengths_t)
    prefill = torch.stack([triton_attention(s[0][None], s[1][None], s[2][None])[0, -sq:] for s in seqs])
    assert torch.isfinite(got).all()
    assert torch.equal(got, via_table.reshape(got.shape)), "lengths read in the kernel and the table differ"
    assert torch.equal(got, tiles), "the Gluon decode and flash.py's tiles differ"
    assert torch.equal(got, prefill), "the Gluon decode and the prefill differ"


PDL = """
import json
import torch
from rl_engine.kernels.ops.triton.attention.gluon_decode import compile_for_sm90
from rl_engine.kernels.ops.triton.sm90 import compile_attention

decode = compile_for_sm90(128, True, 2, True).asm["ptx"]
combine = compile_attention("combine_after_pdl", torch.bfloat16, 128).asm["ptx"]
print(json.dumps({"trigger": decode.find("griddepcontrol.launch_dependents"), "first_tma": decode.find("cp.async.bulk"),
                  "wait": combine.find("griddepcontrol.wait"),
                  "first_load": min(i for i in (combine.find("ld.global"), combine.find("cp.async")) if i >= 0)}))
"""


def test_the_combine_launched_early_waits_for_the_decode_grid(monkeypatch):
    """The combine kernel starts while the decode kernel runs (programmatic dependent launch), so it must be launched
    with its wait (AFTER_PDL) and the wait must come before it reads a partial state; the decode kernel lets it start
    before its walk."""
    from rl_engine.kernels.ops.triton.attention import flash, gluon_decode

    launches = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.setdefault(self.name, kwargs)

    monkeypatch.setattr(gluon_decode, "gluon_decode_kernel", Recorder("decode"))
    monkeypatch.setattr(flash, "_split_combine_kernel", Recorder("combine"))
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    kv = torch.zeros(4096, 8, 128, dtype=torch.bfloat16)
    gluon_decode.gluon_decode_cache(q, kv, kv, torch.tensor([4096]), 1, 4096, scale=0.1)  # two splits: a combine
    assert {"decode", "combine"} <= set(launches)
    assert launches["combine"].get("launch_pdl") is True and launches["combine"].get("AFTER_PDL") is True, launches

    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", PDL], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 <= r["wait"] < r["first_load"], r
    assert 0 <= r["trigger"] < r["first_tma"], r
