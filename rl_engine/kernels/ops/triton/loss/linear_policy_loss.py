"""Fused lm_head + RL policy loss in Triton: [N, V] logits never exist, the gradient comes from the forward.

The formulas (verl's PPO/GRPO/DAPO clip, GSPO, k3 KL, entropy, aggregation) are in the gold's
docstring, rl_engine/kernels/ops/pytorch/loss/linear_policy_loss.py. Passes, each over fixed
TOKEN_CHUNK x chunk pieces (TOKEN_CHUNK a constant per dtype; the vocabulary chunk is linear_logp's
`backward_chunk` of the token chunk's rows, which changes no bit):
  1. statistics: `_stats_partials_kernel` computes logits tiles with the linear_logp tile GEMM
     (`_logits_tile`: TMA loads, linear_logp's tiles, persistent programs; logits / temperature)
     and per tile the max, sum of exp and, for the entropy,
     sum of exp * z; `_stats_combine_kernel` folds a token's tiles in vocabulary order -> logp, lse,
     mean logit E[z] (entropy H = lse - E[z]);
  2. sequence statistics (GSPO): `_seq_sum_kernel`, one program per sequence, a fixed-width lane
     accumulator walking T in order, then one tree sum: padding adds exact zeros;
  3. per-token terms, `_token_terms_kernel`: the token's loss and the closed-form derivatives
     a_t = dL/dlogp_t and b_t = dL/dH_t (both times the token's aggregation weight);
  4. gradients, `_policy_dlogits_kernel` recomputes each logits tile exactly as pass 1 did and writes
        dz = a_t (onehot - p) - b_t p (z - E[z]),   d logits = dz / temperature
     for a [TOKEN_CHUNK, chunk] piece; then dhidden[chunk] += dlogits @ W[vocab chunk] and
     dW[vocab chunk] += dlogits^T @ hidden[chunk] (linear_logp's `_matmul_kernel`: one program per
     output tile, fixed K order, token chunks summed in order into an fp32 buffer, no atomics).

Batch invariance. A token's logp, entropy, loss term, a_t, b_t, dlogits row and dhidden row depend
only on its own row, its sequence (GSPO's ratio, seq-mean's 1/|o_i|) and the scalar normaliser of
the aggregation (1/active tokens for token-mean, 1/sequences for seq-mean), which enters as one fp32
multiply in the token's weight. Given the same normaliser (pass `normalizer=` to fix it across
micro-batches, as verl's global batch info does) those bits are the same whatever else is in the
batch, however it is padded or ordered. Not invariant, by definition: the scalar loss and the
metrics (sums over the batch) and dW (a sum over all tokens) - deterministic, fixed order, but
functions of the whole batch.

The scalar loss is the torch custom op `rl_engine::linear_policy_loss` (torch.compile traces it);
its forward returns the gradients it computed, and autograd's backward multiplies them by the
upstream scalar (exact for loss.backward()). The harness's per-token view (`_TokenLossFunction`)
takes any upstream and recomputes through the same kernels in backward.

Memory beyond inputs and gradients: partials [TOKEN_CHUNK, V / BLOCK_V] x 3, one dlogits piece of at
most TOKEN_CHUNK x VOCAB_CHUNK elements, an fp32 dhidden [N, H] and, past one token chunk, an fp32 dW piece
[VOCAB_CHUNK, H]. The fp32 dhidden alone is 2H/V of the bf16 logits' size (5.4% at Qwen3's H = 4096,
V = 151936). Autograd's backward scales the forward's gradients in place (`scale_gradient_`, no pass
at all for loss.backward()) and asks for no zero-filled upstreams of the other outputs: until
2026-12-01 a second [V,H] gradient and a zero [V,H] upstream were the bulk of the measured work memory.
Work: the logits GEMM runs twice (statistics, then recompute for the gradient) plus the two
gradient GEMMs: 4 GEMMs of work. Three would need the logits of a token chunk kept until its lse is
known ([TOKEN_CHUNK, V]) and dW accumulated in fp32 across token chunks ([V, H] fp32): the second is
far above the memory goal unless the caller holds it (the main-grad mode below). H200, N = 4096 / 8192,
H = 4096, V = 151936: 4.38x / 4.51x a cuBLAS GEMM of the logits' shape, 67 / 168 MB working memory
(benchmarks/results/policy_loss.json).

fp32 main-grad mode (`main_grad=`, `_MainGradLossFunction`, issue 55): 3 GEMMs. The caller holds an fp32
[V,H] buffer (Megatron's main_grad); the forward walks the tokens in chunks of C = BLOCK_T * max(1,
N // (CHUNKS * BLOCK_T)) rows, first to last (`_main_grad_pass`), and per chunk:
  1. `_stats_partials_kernel` with STORE_E: the logits tiles, once, with pass 1's bits, and beside the
     partials e = exp(z - m) per element (m the tile's max; bf16, fp32 for fp32 inputs) into a [C, V] buffer;
  2. `_stats_combine_kernel` and `_token_terms_kernel` on the chunk's rows: pass 1 and 3's kernels, so
     the same logp, lse, E[z], loss, a_t, b_t, clip and KL bits as the lean mode (per row or elementwise);
  3. `_dlogits_from_e_kernel`: p = e exp(m - lse), z = m + log e (entropy bonus only), then pass 4's
     formula, written over e in place (one element size);
  4. dhidden[chunk] = dlogits @ W (`_split_k_kernel`: SPLIT_K fp32 slices of the vocabulary, k_split
     fixed by V alone; `_split_k_sum_kernel` adds them in order and rounds once): a row's bits never
     depend on C, so on N;
  5. main_grad += dlogits^T @ hidden[chunk] (`_matmul_kernel`, fp32, accumulating): dW's sum over token
     chunks in their fixed order (deterministic; like any dW, a function of the whole batch).
GEMMs: logits, dhidden, dW, each once. GSPO's ratio needs a sequence's every logp before a chunk's a_t:
it runs the lean statistics first, then the chunk pass (4 GEMMs, as the lean mode). Working memory
(`main_grad_buffers`): C x V elements of e/dlogits + SPLIT_K x C x H fp32 + the chunk's partials
3 x C x V / BLOCK_V fp32 + 9 N fp32; with C <= N / 32 (bf16, from N = 4096 up) that is <= 1/64 of the
fp32 logits N x V x 4 for e plus < 0.2% for the rest: 1.8% at N = 4096 and 8192, H = 4096, V = 151936.
The cost the 2% buys: main_grad is read and written once per chunk (8 V H bytes, ~32 times: about
160 GB at Qwen3's V and H whatever N), a memory-bound dW GEMM with K = C (untimed here; see
benchmarks/policy_loss.py). The forward adds dW for an upstream of 1; backward scales dhidden in place,
and an upstream g != 1 (one host read) costs a second pass adding (g - 1) dW (logits and dW GEMMs
again). So a forward whose loss never gets a backward (or is recomputed by activation checkpointing)
still adds its dW: one backward per forward.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rl_engine.kernels.ops.pytorch.base import expect_ids_in_range
from rl_engine.kernels.ops.pytorch.loss.linear_policy_loss import (
    GSPO_LOG_RATIO_MAX,
    HARNESS_CONFIG,
    KL_CLAMP,
    RATIO_LOG_CLAMP,
    NativeLinearPolicyLossOp,
    PolicyLossConfig,
    aggregation_weights,
    expand_advantages,
    validate_policy_inputs,
)
from rl_engine.kernels.ops.triton.loss.linear_logp import (
    _GPU_CONFIGS,
    _INTERPRETER_CONFIG,
    _dot_options,
    _gemm,
    _grouped_tile,
    _logits_tile,
    _matmul,
    _tile_options,
    backward_chunk,
    gemm_descriptors,
    num_programs,
    tma_descriptor,
)
from rl_engine.kernels.ops.triton.loss.logp import LOG2E, exp2_ftz
from rl_engine.kernels.ops.triton.runtime import cast_rne, check_devices, interpreting, register_autograd

# Tokens per chunk: a constant, never a function of N. The interpreter's is small so CPU tests at
# N ~ 40 cross chunk borders; the vocabulary chunk and tiles come from linear_logp's fixed table.
TOKEN_CHUNK = {"gpu": 4096, "interpreter": 16}
SEQ_BLOCK = {"gpu": 256, "interpreter": 8}  # lanes of the per-sequence sum
# The gold's clamps, as constexprs (a jit function may read only constexpr globals on the GPU).
_RATIO_CLAMP = tl.constexpr(RATIO_LOG_CLAMP)
_GSPO_MAX = tl.constexpr(GSPO_LOG_RATIO_MAX)
_KL_CLAMP = tl.constexpr(KL_CLAMP)


# The fp32 main-grad mode's constants (3 GEMMs; see the module doc). Its token chunk has
# BLOCK_T * max(1, N // (CHUNKS * BLOCK_T)) rows: N / CHUNKS at most from N = CHUNKS * BLOCK_T tokens up, so
# the chunk's e buffer (2 bytes an element, 4 in fp32: CHUNKS doubles) is at most 1/64 of the fp32 logits.
# No per-token bit depends on the chunk (every tile, K order and fold is fixed per dtype), only the order
# in which dW's token chunks are added. DX: the chunk's dhidden GEMM, split SPLIT_K ways along the vocabulary
# (a fixed k_split from V alone) so that a short chunk still fills the GPU; E_BLOCK_R: rows per program of
# the dlogits pass. Untuned on the GPU (benchmarks/policy_loss.py times the mode).
MAIN_GRAD = {
    "16bit": dict(CHUNKS=32, DX=_gemm(64, 128, 64, 4, 4), SPLIT_K=2, E_BLOCK_R=16),
    "fp32": dict(CHUNKS=64, DX=_gemm(64, 64, 32, 4, 2), SPLIT_K=2, E_BLOCK_R=16),
    "interpreter": dict(CHUNKS=2, DX=_gemm(16, 16, 16, 1, 1, group=2), SPLIT_K=2, E_BLOCK_R=8),
}


def config(dtype: torch.dtype, target: str | None = None) -> dict:
    """linear_logp's tiles and vocabulary chunk, with this op's token chunk, sequence lanes and main-grad
    constants; target "gpu" or "interpreter" (default: the one in use)."""
    key = target or ("interpreter" if interpreting() else "gpu")
    if key == "interpreter":
        return dict(_INTERPRETER_CONFIG, TOKEN_CHUNK=TOKEN_CHUNK[key], SEQ_BLOCK=SEQ_BLOCK[key], **MAIN_GRAD[key])
    kind = "fp32" if dtype == torch.float32 else "16bit"
    return dict(_GPU_CONFIGS[kind], TOKEN_CHUNK=TOKEN_CHUNK[key], SEQ_BLOCK=SEQ_BLOCK[key], **MAIN_GRAD[kind])


@triton.jit(do_not_specialize=["N"])
def _stats_partials_kernel(
    h_desc, w_desc, target_ptr, part_max_ptr, part_sum_ptr, part_zsum_ptr, target_logit_ptr, e_ptr,
    N, V, H, inv_temp, num_vtiles, stride_en,
    ENTROPY: tl.constexpr, STORE_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr, GROUP: tl.constexpr, NUM_PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # Persistent over the tiles, as linear_logp's partials (same logits tiles, same K order).
    # STORE_E (the main-grad mode): also e = exp(z - tile max) per element, rounded to e_ptr's dtype, which
    # `_dlogits_from_e_kernel` turns into dlogits once the row's lse is known. It changes no other value.
    num_ttiles = tl.cdiv(N, BLOCK_T)
    tile_id_c = tl.program_id(0) - NUM_PROGRAMS
    for tile_id in tl.range(tl.program_id(0), num_ttiles * num_vtiles, NUM_PROGRAMS, flatten=True):
        tile_t, tile_v = _grouped_tile(tile_id, num_ttiles, num_vtiles, GROUP)
        acc = _logits_tile(h_desc, w_desc, tile_t * BLOCK_T, tile_v * BLOCK_V, H,
                           BLOCK_T, BLOCK_V, BLOCK_H, DOT_FP32, INPUT_PRECISION)
        tile_id_c += NUM_PROGRAMS
        tile_t, tile_v = _grouped_tile(tile_id_c, num_ttiles, num_vtiles, GROUP)
        rows = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tile_v * BLOCK_V + tl.arange(0, BLOCK_V)
        valid = (cols < V)[None, :]
        z_finite = acc * inv_temp
        z = tl.where(valid, z_finite, float("-inf"))
        tile_max = tl.max(z, axis=1)  # finite: every tile holds at least one column < V
        e = exp2_ftz(z * LOG2E - (tile_max * LOG2E)[:, None])
        row_ok = rows < N
        at = rows.to(tl.int64) * num_vtiles + tile_v
        tl.store(part_max_ptr + at, tile_max, mask=row_ok)
        tl.store(part_sum_ptr + at, tl.sum(e, axis=1), mask=row_ok)
        if ENTROPY:
            tl.store(part_zsum_ptr + at, tl.sum(tl.where(valid, e * z_finite, 0.0), axis=1), mask=row_ok)
        if STORE_E:
            e_ptrs = e_ptr + rows.to(tl.int64)[:, None] * stride_en + cols[None, :]
            tl.store(e_ptrs, cast_rne(e, e_ptr.dtype.element_ty), mask=row_ok[:, None] & valid)
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
        in_tile = (target >= tile_v * BLOCK_V) & (target < tile_v * BLOCK_V + BLOCK_V) & (target < V)
        picked = tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
        # an id outside [0, V) has no logit: NaN (stored by the first vocabulary tile), never a stale value
        out_of_range = (target < 0) | (target >= V)
        picked = tl.where(out_of_range, float("nan"), picked)
        tl.store(target_logit_ptr + rows, picked, mask=row_ok & (in_tile | (out_of_range & (target * 0 + tile_v == 0))))


@triton.jit
def _stats_combine_kernel(
    part_max_ptr, part_sum_ptr, part_zsum_ptr, target_logit_ptr, logp_ptr, lse_ptr, mean_z_ptr, num_vtiles,
    ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < num_vtiles
    m = tl.load(part_max_ptr + row * num_vtiles + offs, mask=mask, other=float("-inf"))
    s = tl.load(part_sum_ptr + row * num_vtiles + offs, mask=mask, other=0.0)
    row_max = tl.max(m, axis=0)
    scale = tl.where(s > 0, tl.exp(m - row_max), 0.0)
    total = tl.sum(s * scale, axis=0)
    lse = row_max + tl.log(total)
    tl.store(logp_ptr + row, tl.load(target_logit_ptr + row) - lse)
    tl.store(lse_ptr + row, lse)
    if ENTROPY:
        zs = tl.load(part_zsum_ptr + row * num_vtiles + offs, mask=mask, other=0.0)
        tl.store(mean_z_ptr + row, tl.sum(zs * scale, axis=0) / total)  # E[z]; H = lse - E[z]


@triton.jit
def _seq_sum_kernel(logp_ptr, old_ptr, mask_ptr, out_ptr, T, BLOCK: tl.constexpr):
    # out[b] = sum_t m (logp - old) over sequence b: BLOCK lanes walk T in order, one tree sum at the
    # end, so the bits depend on the sequence alone (padding past its end adds exact zeros).
    base = tl.program_id(0).to(tl.int64) * T
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for t0 in range(0, T, BLOCK):
        ok = offs < T - t0
        m = tl.load(mask_ptr + base + t0 + offs, mask=ok, other=0.0)
        d = tl.load(logp_ptr + base + t0 + offs, mask=ok, other=0.0) - tl.load(old_ptr + base + t0 + offs, mask=ok,
                                                                            other=0.0)
        acc += tl.where(m != 0, d * m, 0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _token_terms_kernel(
    logp_ptr, lse_ptr, mean_z_ptr, old_ptr, ref_ptr, adv_ptr, weight_ptr, seq_ptr,
    loss_ptr, dlogp_ptr, dent_ptr, clipped_ptr, lower_ptr, kl_ptr, N,
    clip_lo, clip_hi, clip_c, kl_coef, entropy_coef,
    GSPO: tl.constexpr, HAS_REF: tl.constexpr, ENTROPY_BONUS: tl.constexpr, BLOCK: tl.constexpr,
):
    # Per token, elementwise: the token's loss term times its aggregation weight w, and the closed
    # forms a = w dL/dlogp, b = w dL/dH. At exact ties of max/min (measure zero; A = 0 gives 0 either
    # way) autograd splits the gradient; here the unclipped branch takes it.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    logp = tl.load(logp_ptr + offs, mask=ok, other=0.0)
    old = tl.load(old_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    adv = tl.load(adv_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0)
    if GSPO:
        seq = tl.load(seq_ptr + offs, mask=ok, other=0.0)
        ratio = tl.exp(tl.minimum(seq, _GSPO_MAX))
        live = seq <= _GSPO_MAX  # clamp(max) passes the gradient up to the bound
    else:
        raw = logp - old
        ratio = tl.exp(tl.minimum(tl.maximum(raw, -_RATIO_CLAMP), _RATIO_CLAMP))
        live = (raw >= -_RATIO_CLAMP) & (raw <= _RATIO_CLAMP)
    l1 = -adv * ratio
    l2 = -adv * tl.minimum(tl.maximum(ratio, clip_lo), clip_hi)
    c = tl.maximum(l1, l2)
    dpg = tl.where((l1 >= l2) & live, -adv * ratio, 0.0)
    if GSPO:
        pg = c
        lower = tl.zeros_like(c)
    else:
        l3 = -adv * clip_c
        neg = adv < 0
        pg = tl.where(neg, tl.minimum(l3, c), c)
        dpg = tl.where(neg & (l3 < c), 0.0, dpg)
        lower = tl.where(neg & (c > l3), 1.0, 0.0)
    loss = pg
    dlogp = dpg
    if HAS_REF:
        ref = tl.load(ref_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        k_raw = ref - logp
        k = tl.minimum(tl.maximum(k_raw, -_RATIO_CLAMP), _RATIO_CLAMP)
        ek = tl.exp(k)
        kl_raw = ek - k - 1.0
        kl = tl.minimum(tl.maximum(kl_raw, -_KL_CLAMP), _KL_CLAMP)
        kl_live = (k_raw >= -_RATIO_CLAMP) & (k_raw <= _RATIO_CLAMP)
        kl_live = kl_live & (kl_raw <= _KL_CLAMP) & (kl_raw >= -_KL_CLAMP)
        loss = loss + kl_coef * kl
        dlogp = dlogp + kl_coef * tl.where(kl_live, 1.0 - ek, 0.0)
        ref_ok = tl.abs(ref) < float("inf")
        loss = tl.where(ref_ok, loss, float("nan"))
        dlogp = tl.where(ref_ok, dlogp, float("nan"))
        tl.store(kl_ptr + offs, kl, mask=ok)
    if ENTROPY_BONUS:
        entropy = tl.load(lse_ptr + offs, mask=ok, other=0.0) - tl.load(mean_z_ptr + offs, mask=ok, other=0.0)
        loss = loss - entropy_coef * entropy
    # a non-finite logp, old or reference logprob makes the token's terms NaN: the clamps would hide it
    finite = (tl.abs(old) < float("inf")) & (tl.abs(logp) < float("inf"))
    loss = tl.where(finite, loss, float("nan"))
    dlogp = tl.where(finite, dlogp, float("nan"))
    tl.store(loss_ptr + offs, w * loss, mask=ok)
    tl.store(dlogp_ptr + offs, w * dlogp, mask=ok)
    tl.store(dent_ptr + offs, -(w * entropy_coef), mask=ok)
    tl.store(clipped_ptr + offs, tl.where(l2 > l1, 1.0, 0.0), mask=ok)
    tl.store(lower_ptr + offs, lower, mask=ok)


@triton.jit(do_not_specialize=["N"])
def _policy_dlogits_kernel(
    h_desc, w_desc, target_ptr, lse_ptr, mean_z_ptr, a_ptr, b_ptr, dlogits_ptr,
    N, V, H, v_start, v_stop, inv_temp, stride_dn,
    ENTROPY_BONUS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr, NUM_PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # dlogits[:, v_start:v_stop] from the logits recomputed bit for bit as in the statistics pass.
    num_ttiles = tl.cdiv(N, BLOCK_T)
    num_vtiles = tl.cdiv(v_stop - v_start, BLOCK_V)
    tile_id_c = tl.program_id(0) - NUM_PROGRAMS
    for tile_id in tl.range(tl.program_id(0), num_ttiles * num_vtiles, NUM_PROGRAMS, flatten=True):
        tile_t, tile_v = _grouped_tile(tile_id, num_ttiles, num_vtiles, GROUP)
        acc = _logits_tile(h_desc, w_desc, tile_t * BLOCK_T, v_start + tile_v * BLOCK_V, H,
                           BLOCK_T, BLOCK_V, BLOCK_H, DOT_FP32, INPUT_PRECISION)
        tile_id_c += NUM_PROGRAMS
        tile_t, tile_v = _grouped_tile(tile_id_c, num_ttiles, num_vtiles, GROUP)
        rows = tile_t * BLOCK_T + tl.arange(0, BLOCK_T)
        local = tile_v * BLOCK_V + tl.arange(0, BLOCK_V)
        cols = v_start + local
        z = acc * inv_temp
        row_ok = rows < N
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
        p = exp2_ftz(z * LOG2E - (lse * LOG2E)[:, None])
        onehot = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
        if ENTROPY_BONUS:
            b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
            mean_z = tl.load(mean_z_ptr + rows, mask=row_ok, other=0.0)
            dz = a[:, None] * onehot - p * (a[:, None] + b[:, None] * (z - mean_z[:, None]))
        else:
            dz = a[:, None] * (onehot - p)
        ptrs = dlogits_ptr + rows.to(tl.int64)[:, None] * stride_dn + local[None, :]
        tl.store(ptrs, cast_rne(dz * inv_temp, dlogits_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < v_stop)[None, :])



@triton.jit
def _dlogits_from_e_kernel(
    e_ptr, dlogits_ptr, part_max_ptr, target_ptr, lse_ptr, mean_z_ptr, a_ptr, b_ptr,
    N, V, stride_dn, num_vtiles, inv_temp,
    ENTROPY_BONUS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # The main-grad mode's dlogits from the stored e = exp(z - m) (m: the statistics tile's max, one per
    # row and BLOCK_V columns): p = e exp(m - lse), z = m + log e (the entropy term only), then the lean
    # mode's formula. In place: e_ptr and dlogits_ptr may be one buffer (elements of one size), each
    # element read and written by the same program.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    tile_v = tl.program_id(1)
    cols = tile_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < V)[None, :]
    at = rows.to(tl.int64)[:, None] * stride_dn + cols[None, :]
    e = tl.load(e_ptr + at, mask=ok, other=0.0).to(tl.float32)
    m = tl.load(part_max_ptr + rows.to(tl.int64) * num_vtiles + tile_v, mask=row_ok, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    a = tl.load(a_ptr + rows, mask=row_ok, other=0.0)
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1).to(tl.int32)
    p = e * exp2_ftz((m - lse) * LOG2E)[:, None]
    onehot = tl.where(cols[None, :] == target[:, None], 1.0, 0.0)
    if ENTROPY_BONUS:
        b = tl.load(b_ptr + rows, mask=row_ok, other=0.0)
        mean_z = tl.load(mean_z_ptr + rows, mask=row_ok, other=0.0)
        z = m[:, None] + tl.log(tl.where(e > 0, e, 1.0))  # e = 0 (flushed): p = 0, the term is 0
        dz = a[:, None] * onehot - tl.where(e > 0, p * (a[:, None] + b[:, None] * (z - mean_z[:, None])), 0.0)
    else:
        dz = a[:, None] * (onehot - p)
    tl.store(dlogits_ptr + at, cast_rne(dz * inv_temp, dlogits_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _split_k_kernel(
    a_ptr, b_ptr, part_ptr, a_desc, b_desc, M, N, K, k_split,
    stride_am, stride_ak, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    # part[s] = A[:, K slice s] @ B[K slice s, :] in fp32, slice s = [s k_split, (s + 1) k_split): the main-grad
    # mode's dhidden of one token chunk, whose K (the vocabulary) is long and M (the chunk's tokens) short.
    # k_split is a multiple of BLOCK_K fixed by V alone, so a row's bits never depend on M.
    tile_m, tile_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP)
    split = tl.program_id(1)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    k0 = split * k_split
    k1 = tl.minimum(K, k0 + k_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k0, k1, BLOCK_K):
        if TMA:  # past K the descriptors load zeros
            a = a_desc.load([tile_m * BLOCK_M, k])
            b = b_desc.load([k, tile_n * BLOCK_N])
        else:
            k_ok = offs_k < k1 - k
            a = tl.load(a_ptr + rows.to(tl.int64)[:, None] * stride_am + (k + offs_k).to(tl.int64)[None, :] * stride_ak,
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptr + (k + offs_k).to(tl.int64)[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    out = part_ptr + split.to(tl.int64) * M * N + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _split_k_sum_kernel(part_ptr, out_ptr, numel, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # out = part[0] + part[1] + ... in slice order, fp32, rounded once to out's dtype.
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < numel
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, cast_rne(acc, out_ptr.dtype.element_ty), mask=ok)

def _statistics(rows, w, targets, inv_temp, entropy, cfg):
    """(logp, lse, E[z] or None) per token, fp32, token chunk by token chunk."""
    n, h = rows.shape
    v = w.shape[0]
    tc = cfg["TOKEN_CHUNK"]
    num_vtiles = triton.cdiv(v, cfg["BLOCK_V"])
    f32 = dict(dtype=torch.float32, device=rows.device)
    logp, lse = torch.empty(n, **f32), torch.empty(n, **f32)
    mean_z = torch.empty(n, **f32) if entropy else lse
    part_max = torch.empty(min(tc, n), num_vtiles, **f32)
    part_sum = torch.empty_like(part_max)
    part_zsum = torch.empty_like(part_max) if entropy else part_max
    target_logit = torch.empty(min(tc, n), **f32)
    w_desc = tma_descriptor(w, [cfg["BLOCK_V"], cfg["BLOCK_H"]])
    programs = num_programs(rows.device)
    for t0 in range(0, n, tc):
        t1 = min(t0 + tc, n)
        m = t1 - t0
        tiles = triton.cdiv(m, cfg["BLOCK_T"]) * num_vtiles
        _stats_partials_kernel[(min(programs, tiles),)](
            tma_descriptor(rows[t0:t1], [cfg["BLOCK_T"], cfg["BLOCK_H"]]), w_desc, targets[t0:t1],
            part_max, part_sum, part_zsum, target_logit, part_max, m, v, h, inv_temp, num_vtiles, 0,
            ENTROPY=entropy, STORE_E=False, NUM_PROGRAMS=programs, **_tile_options(cfg, rows.dtype),
        )
        _stats_combine_kernel[(m,)](
            part_max, part_sum, part_zsum, target_logit, logp[t0:t1], lse[t0:t1], mean_z[t0:t1], num_vtiles,
            ENTROPY=entropy, BLOCK=triton.next_power_of_2(num_vtiles), num_warps=1 if interpreting() else 4,
        )
    return logp, lse, (mean_z if entropy else None)


def _gradients(rows, w, targets, lse, mean_z, a, b, inv_temp, cfg, need_hidden, need_weight):
    """fp32 dhidden [N,H] and dW [V,H] (weight dtype) for per-token coefficients a = dL/dlogp, b = dL/dH."""
    n, h = rows.shape
    v = w.shape[0]
    tc = cfg["TOKEN_CHUNK"]
    vc = backward_chunk(cfg, min(tc, n))  # wider only for a batch shorter than one token chunk
    bonus = b is not None
    dlogits = torch.empty(min(tc, n), min(vc, v), dtype=rows.dtype, device=rows.device)
    grad_hidden = torch.zeros(n, h, dtype=torch.float32, device=rows.device) if need_hidden else None
    grad_weight = torch.empty_like(w) if need_weight else None
    # dW sums over token chunks in fp32, in chunk order; fp32 weights accumulate in place.
    scratch = None
    if need_weight and w.dtype != torch.float32 and n > tc:  # one chunk: one rounding
        scratch = torch.empty(min(vc, v), h, dtype=torch.float32, device=rows.device)
    w_desc = tma_descriptor(w, [cfg["BLOCK_V"], cfg["BLOCK_H"]])
    h_descs = [tma_descriptor(rows[t0:t0 + tc], [cfg["BLOCK_T"], cfg["BLOCK_H"]]) for t0 in range(0, n, tc)]
    programs = num_programs(rows.device)
    for v0 in range(0, v, vc):
        v1 = min(v0 + vc, v)
        dw = None
        if need_weight:
            dw = grad_weight[v0:v1] if scratch is None else scratch[: v1 - v0]
        for t0 in range(0, n, tc):
            t1 = min(t0 + tc, n)
            d = dlogits[: t1 - t0, : v1 - v0]
            tiles = triton.cdiv(t1 - t0, cfg["BLOCK_T"]) * triton.cdiv(v1 - v0, cfg["BLOCK_V"])
            _policy_dlogits_kernel[(min(programs, tiles),)](
                h_descs[t0 // tc], w_desc, targets[t0:t1], lse[t0:t1], mean_z[t0:t1] if bonus else lse,
                a[t0:t1], b[t0:t1] if bonus else a, d, t1 - t0, v, h, v0, v1, inv_temp, d.stride(0),
                ENTROPY_BONUS=bonus, NUM_PROGRAMS=programs, **_tile_options(cfg, rows.dtype),
            )
            if need_hidden:
                _matmul(d, w[v0:v1], grad_hidden[t0:t1], accumulate=v0 > 0, gemm=cfg["DH"])
            if need_weight:
                _matmul(d.t(), rows[t0:t1], dw, accumulate=t0 > 0, gemm=cfg["DW"])
        if scratch is not None:
            grad_weight[v0:v1].copy_(dw)  # one round-to-nearest-even cast per element
    return grad_hidden, grad_weight


def _token_terms(logp, lse, mean_z, old, ref, adv, weight, seq, cfg: PolicyLossConfig, out=None) -> dict:
    """Per-token terms (elementwise: the same bits for a token whatever slice of the batch it is run in);
    `out`: the arrays to write (contiguous [n] views), else new ones."""
    n = logp.shape[0]
    if out is None:
        out = {k: torch.empty(n, dtype=torch.float32, device=logp.device)
               for k in ("loss", "dlogp", "dent", "clipped", "clipped_lower")}
        out["kl"] = torch.empty(n, dtype=torch.float32, device=logp.device) if ref is not None else None
    bonus = cfg.entropy_coef > 0
    block = 16 if interpreting() else 1024
    if n == 0:
        return out
    _token_terms_kernel[(triton.cdiv(n, block),)](
        logp, lse, mean_z if bonus else lse, old, ref if ref is not None else old, adv, weight,
        seq if seq is not None else logp,
        out["loss"], out["dlogp"], out["dent"], out["clipped"], out["clipped_lower"],
        out["kl"] if ref is not None else logp, n,
        1 - cfg.clip_ratio_low, 1 + cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.kl_coef, cfg.entropy_coef,
        GSPO=cfg.policy_loss == "gspo", HAS_REF=ref is not None, ENTROPY_BONUS=bonus, BLOCK=block,
    )
    return out


def _flat(t, dtype=None):
    t = t.reshape(-1)
    return (t if dtype is None else t.to(dtype)).contiguous()


def _policy_terms(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight, cfg):
    """Statistics and per-token terms for hidden [N,H] or [B,T,H]; `token_weight` the per-token weight."""
    h = hidden.shape[-1]
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    rows = hidden.reshape(-1, h).to(dtype)
    w = weight.to(dtype)
    targets = _flat(target_ids)
    cfg_run = config(dtype)
    inv_temp = 1.0 / cfg.temperature
    logp, lse, mean_z = _statistics(rows, w, targets, inv_temp, cfg.needs_entropy, cfg_run)
    seq = None
    if cfg.policy_loss == "gspo":
        b, t = hidden.shape[:2]
        m = _flat(mask, torch.float32)
        sums = torch.empty(b, dtype=torch.float32, device=rows.device)
        if b * t:
            _seq_sum_kernel[(b,)](logp, _flat(old_logprobs, torch.float32), m, sums, t, BLOCK=cfg_run["SEQ_BLOCK"])
        counts = m.reshape(b, t).sum(-1).clamp(min=1)  # small integers: exact in any order
        seq = _flat((sums / counts).unsqueeze(-1).expand(b, t))
    old = _flat(old_logprobs, torch.float32)
    ref = None if ref_logprobs is None else _flat(ref_logprobs, torch.float32)
    terms = _token_terms(logp, lse, mean_z, old, ref, _flat(advantages, torch.float32),
                         _flat(token_weight, torch.float32), seq, cfg)
    terms.update(logp=logp, lse=lse, mean_z=mean_z, rows=rows, w=w, targets=targets, run_config=cfg_run)
    return terms


# A torch custom op (torch.compile traces it): the forward returns the loss, the per-token metric
# inputs and the two gradients it computed; autograd's backward only scales those by the upstream.
@torch.library.custom_op("rl_engine::linear_policy_loss", mutates_args=())
def linear_policy_loss_op(
    hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor, advantages: torch.Tensor,
    old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, mask: torch.Tensor, token_weight: torch.Tensor,
    policy_loss: str, clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float, kl_coef: float,
    entropy_coef: float, temperature: float, compute_entropy: bool, need_hidden: bool, need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """(loss, logp, clipped, clipped_lower, kl or [0], entropy or [0], dL/dhidden or [0], dL/dW or [0])."""
    cfg = PolicyLossConfig(policy_loss=policy_loss, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                           clip_ratio_c=clip_ratio_c, kl_coef=kl_coef, entropy_coef=entropy_coef,
                           temperature=temperature, compute_entropy=compute_entropy)
    terms = _policy_terms(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight, cfg)
    grad_hidden = grad_weight = None
    if (need_hidden or need_weight) and terms["rows"].shape[0]:
        grad_hidden, grad_weight = _gradients(
            terms["rows"], terms["w"], terms["targets"], terms["lse"], terms["mean_z"], terms["dlogp"],
            terms["dent"] if cfg.entropy_coef > 0 else None, 1.0 / cfg.temperature, terms["run_config"],
            need_hidden, need_weight,
        )
    empty = terms["logp"].new_empty(0)
    if need_hidden:
        grad_hidden = (torch.zeros(hidden.shape, dtype=hidden.dtype, device=hidden.device) if grad_hidden is None
                       else grad_hidden.reshape(hidden.shape).to(hidden.dtype))
    if need_weight:
        grad_weight = torch.zeros_like(weight) if grad_weight is None else grad_weight.to(weight.dtype)
    lead = hidden.shape[:-1]
    kl = terms["kl"].reshape(lead) if terms["kl"] is not None else empty.clone()
    entropy = (terms["lse"] - terms["mean_z"]).reshape(lead) if cfg.needs_entropy else empty.clone()
    return (terms["loss"].sum(), terms["logp"].reshape(lead), terms["clipped"].reshape(lead),
            terms["clipped_lower"].reshape(lead), kl, entropy,
            grad_hidden if need_hidden else empty.clone(), grad_weight if need_weight else empty.clone())


@linear_policy_loss_op.register_fake
def _(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight, policy_loss,
      clip_ratio_low, clip_ratio_high, clip_ratio_c, kl_coef, entropy_coef, temperature, compute_entropy,
      need_hidden, need_weight):
    lead = hidden.shape[:-1]

    def f32(shape):
        return hidden.new_empty(shape, dtype=torch.float32)

    return (f32(()), f32(lead), f32(lead), f32(lead), f32(lead if ref_logprobs is not None else (0,)),
            f32(lead if (compute_entropy or entropy_coef > 0) else (0,)),
            hidden.new_empty(hidden.shape) if need_hidden else f32((0,)),
            weight.new_empty(weight.shape) if need_weight else f32((0,)))


def _loss_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[6], output[7])
    # Only the loss carries a gradient: no zero-filled [V,H] and [N,H] upstreams for the other outputs.
    ctx.set_materialize_grads(False)
    ctx.need = (inputs[-2], inputs[-1])


@triton.jit
def _scale_kernel(grad_ptr, g_ptr, n, BLOCK: tl.constexpr):
    g = tl.load(g_ptr)
    if g != 1.0:  # loss.backward() passes 1: then not one byte is read or written
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(grad_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(grad_ptr + offs, cast_rne(x * g, grad_ptr.dtype.element_ty), mask=ok)


@torch.library.custom_op("rl_engine::scale_gradient_", mutates_args=("grad",))
def scale_gradient_(grad: torch.Tensor, g: torch.Tensor) -> None:
    """grad *= g in place (contiguous grad, 0-dim g): the fp32 product rounded once to grad's dtype.

    In place, so that the gradient the forward computed is the one returned, never held twice (a
    second backward through the same graph fails on the saved tensor's version, loudly). One pass
    over a [V,H] gradient, none when g is 1; a custom op so that torch.compile traces the backward."""
    n = grad.numel()
    if n:
        block = 16 if interpreting() else 4096
        _scale_kernel[(triton.cdiv(n, block),)](grad, g.reshape(1).to(torch.float32), n, BLOCK=block)


def _loss_backward(ctx, grad_loss, *_):
    grad_hidden, grad_weight = ctx.saved_tensors
    g = grad_loss.to(torch.float32)
    for grad, need in zip((grad_hidden, grad_weight), ctx.need, strict=True):
        if need:
            scale_gradient_(grad, g)
    return (grad_hidden if ctx.need[0] else None, grad_weight if ctx.need[1] else None) + (None,) * 16


linear_policy_loss_autograd = register_autograd(linear_policy_loss_op, _loss_backward, _loss_setup_context)


def linear_policy_loss(hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask=None, ref_logprobs=None,
                       cfg: PolicyLossConfig | None = None, normalizer=None, main_grad=None):
    """(loss, metrics): the fused policy loss; see the gold for formulas and the module doc for invariance.

    hidden [N,H] or [B,T,H]; per-token tensors [N] or [B,T] (advantages may be [B] per sequence);
    `normalizer` overrides the aggregation's divisor (active tokens, or sequences).
    Non-finite inputs (as the gold): an id outside [0, V) is a ValueError on the CPU; on a GPU (no host read)
    it makes the token's logp NaN, so the loss, its gradients and the metrics are NaN. A NaN or ±inf old or
    reference logprob makes the loss and gradients NaN.
    main_grad: the fp32 main-grad mode (`_MainGradLossFunction`, 3 GEMMs; used when the weight needs a
    gradient): dL/dW is added into it during this forward; the loss, logp and metrics bits are the lean mode's.
    """
    check_devices("linear_policy_loss", hidden=hidden, lm_head_weight=lm_head_weight, target_ids=target_ids,
                  advantages=advantages, old_logprobs=old_logprobs, mask=mask, ref_logprobs=ref_logprobs)
    cfg = cfg or PolicyLossConfig()
    advantages = expand_advantages(advantages, hidden)
    if mask is None:
        mask = torch.ones(hidden.shape[:-1], device=hidden.device)
    validate_policy_inputs(hidden, lm_head_weight, target_ids, advantages, old_logprobs, mask, ref_logprobs, cfg)
    if target_ids.device.type == "cpu" and not torch.compiler.is_compiling():  # nothing to keep asynchronous
        expect_ids_in_range("target_ids", target_ids, lm_head_weight.shape[0], "vocabulary size V")
    token_weight = aggregation_weights(mask, cfg, normalizer)
    grad_on = torch.is_grad_enabled()
    need_hidden, need_weight = grad_on and hidden.requires_grad, grad_on and lm_head_weight.requires_grad
    if main_grad is not None and need_weight:
        loss, logp, clipped, lower, kl, entropy = _MainGradLossFunction.apply(
            hidden, lm_head_weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight, cfg,
            main_grad)
    else:
        loss, logp, clipped, lower, kl, entropy, _, _ = linear_policy_loss_autograd(
            hidden, lm_head_weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight,
            cfg.policy_loss, cfg.clip_ratio_low, cfg.clip_ratio_high, cfg.clip_ratio_c, cfg.kl_coef,
            cfg.entropy_coef, cfg.temperature, cfg.compute_entropy, need_hidden, need_weight,
        )
    logp, clipped, lower, kl, entropy = (t.detach() for t in (logp, clipped, lower, kl, entropy))
    m = mask.to(torch.float32)
    active = m.sum().clamp(min=1)

    def mean(x):
        return (x * m).sum() / active

    old = old_logprobs.float()
    delta = torch.where(torch.isfinite(old), torch.clamp(logp - old, -20.0, 20.0), float("nan"))
    metrics = {"pg_clipfrac": mean(clipped), "ppo_kl": mean(-delta), "k3_kl": mean(delta.exp() - 1 - delta)}
    if cfg.policy_loss == "ppo":
        metrics["pg_clipfrac_lower"] = mean(lower)
    if ref_logprobs is not None:
        metrics["kl_loss"] = mean(kl)
    if cfg.needs_entropy:
        metrics["entropy"] = mean(entropy)
    return loss, metrics


def chunk_rows(cfg: dict, n: int) -> int:
    """Tokens per chunk of the main-grad mode for a batch of n tokens: BLOCK_T * max(1, n // (CHUNKS * BLOCK_T))."""
    block = cfg["BLOCK_T"]
    return block * max(1, n // (cfg["CHUNKS"] * block))


def _chunk_starts(n: int, c: int) -> range:
    """The main-grad mode's token chunks, first to last: the fixed order of dW's sum."""
    return range(0, n, c)


def _e_dtype(dtype: torch.dtype) -> torch.dtype:
    # e = exp(z - tile max) in (0, 1]: bf16 keeps its relative error at 2^-9 over fp32's whole range (fp16 would
    # flush small ones); fp32 inputs keep fp32. Either has the dlogits' element size: one buffer serves both.
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


def main_grad_buffers(n: int, h: int, v: int, dtype: torch.dtype, cfg: dict, *, need_hidden: bool = True,
                      entropy: bool = True) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The main-grad mode's working buffers for n tokens, name -> (shape, dtype), as `_main_grad_pass` and
    `_main_grad_forward` allocate them: beyond them only the inputs, the outputs, dhidden and the caller's buffer.
    With C = min(chunk_rows(cfg, n), n): C x V elements of e, then dlogits, in place; the chunk's split
    dhidden partials SPLIT_K x C x H fp32; its statistics partials; and per-token fp32 arrays [9, n]."""
    c = min(chunk_rows(cfg, n), n)
    buffers = {
        "e_then_dlogits": ((c, v), dtype),
        "statistics_partials": ((3 if entropy else 2, c, triton.cdiv(v, cfg["BLOCK_V"])), torch.float32),
        "target_logit": ((c,), torch.float32),
        "per_token": ((9, n), torch.float32),  # logp lse E[z] loss a b clipped lower kl
    }
    if need_hidden:
        buffers["dhidden_splits"] = ((cfg["SPLIT_K"], c, h), torch.float32)
    return buffers


def main_grad_work_bytes(n: int, h: int, v: int, dtype: torch.dtype = torch.bfloat16,
                         target: str | None = "gpu") -> int:
    """Bytes of `main_grad_buffers` at the configuration of `target` ("gpu" or "interpreter")."""
    buffers = main_grad_buffers(n, h, v, dtype, config(dtype, target))
    return sum(math.prod(shape) * torch.empty(0, dtype=dt).element_size() for shape, dt in buffers.values())


def _split_k(a, b, parts, out, gemm, k_split) -> None:
    """out = a @ b (rounded once to out's dtype) as fp32 slices of k_split along K, summed in slice order."""
    m, k = a.shape
    n = b.shape[1]
    splits = triton.cdiv(k, k_split)
    descs = gemm_descriptors(a, b, gemm)
    grid = (triton.cdiv(m, gemm["BLOCK_M"]) * triton.cdiv(n, gemm["BLOCK_N"]), splits)
    _split_k_kernel[grid](
        a, b, parts, *(descs[:2] if descs else (a, b)), m, n, k, k_split,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        TMA=descs is not None, **gemm, **_dot_options(a.dtype),
    )
    block = 16 if interpreting() else 1024
    _split_k_sum_kernel[(triton.cdiv(m * n, block),)](parts, out, m * n, SPLITS=splits, BLOCK=block)


def _main_grad_pass(rows, w, targets, inv_temp, cfg, main_grad, grad_hidden, stats, coefficients, entropy,
                    bonus) -> None:
    """The main-grad mode's token-chunk pass, chunks in order (the order of dW's sum). Per chunk:
      1. `_stats_partials_kernel` (STORE_E): the logits tiles, once: the statistics partials and e = exp(z - m);
      2. when `stats` = (logp, lse, mean_z) is to be filled, `_stats_combine_kernel` (the lean mode's);
      3. `coefficients(t0, t1)` -> the chunk's a = dL/dlogp, b = dL/dH (or None without an entropy bonus);
      4. `_dlogits_from_e_kernel`: dlogits over e, in place;
      5. dhidden[chunk] = dlogits @ W (`_split_k`; skipped when grad_hidden is None);
      6. main_grad += dlogits^T @ hidden[chunk] (linear_logp's `_matmul_kernel`, fp32, accumulating).
    Three GEMMs' work (1, 5, 6). `stats` = (logp, lse, mean_z or None, fill): with fill, step 2 writes them,
    chunk by chunk; without, lse and mean_z are known and only read. `entropy`: the partials of E[z] (fill only)."""
    logp, lse, mean_z, fill = stats
    n, h = rows.shape
    v = w.shape[0]
    shapes = main_grad_buffers(n, h, v, rows.dtype, cfg, need_hidden=grad_hidden is not None, entropy=entropy)
    device = rows.device
    c = shapes["e_then_dlogits"][0][0]
    num_vtiles = shapes["statistics_partials"][0][2]
    buf = torch.empty(shapes["e_then_dlogits"][0], dtype=rows.dtype, device=device)
    e_buf = buf.view(_e_dtype(rows.dtype))
    parts = torch.empty(shapes["statistics_partials"][0], dtype=torch.float32, device=device)
    part_max, part_sum = parts[0], parts[1]
    part_zsum = parts[2] if entropy else part_max
    target_logit = torch.empty(c, dtype=torch.float32, device=device)
    splits = (torch.empty(shapes["dhidden_splits"][0], dtype=torch.float32, device=device)
              if grad_hidden is not None else None)
    dx = cfg["DX"]
    k_split = triton.cdiv(triton.cdiv(v, cfg["SPLIT_K"]), dx["BLOCK_K"]) * dx["BLOCK_K"]
    w_desc = tma_descriptor(w, [cfg["BLOCK_V"], cfg["BLOCK_H"]])
    programs = num_programs(device)
    block_r = cfg["E_BLOCK_R"]
    for t0 in _chunk_starts(n, c):
        t1 = min(t0 + c, n)
        m = t1 - t0
        e, d = e_buf[:m], buf[:m]
        tiles = triton.cdiv(m, cfg["BLOCK_T"]) * num_vtiles
        _stats_partials_kernel[(min(programs, tiles),)](
            tma_descriptor(rows[t0:t1], [cfg["BLOCK_T"], cfg["BLOCK_H"]]), w_desc, targets[t0:t1],
            part_max, part_sum, part_zsum, target_logit, e, m, v, h, inv_temp, num_vtiles, e.stride(0),
            ENTROPY=entropy, STORE_E=True, NUM_PROGRAMS=programs, **_tile_options(cfg, rows.dtype),
        )
        if fill:
            _stats_combine_kernel[(m,)](
                part_max, part_sum, part_zsum, target_logit, logp[t0:t1], lse[t0:t1],
                (mean_z if entropy else lse)[t0:t1], num_vtiles,
                ENTROPY=entropy, BLOCK=triton.next_power_of_2(num_vtiles), num_warps=1 if interpreting() else 4,
            )
        a, b = coefficients(t0, t1)
        _dlogits_from_e_kernel[(triton.cdiv(m, block_r), num_vtiles)](
            e, d, part_max, targets[t0:t1], lse[t0:t1], mean_z[t0:t1] if bonus else lse[t0:t1], a,
            b if bonus else a, m, v, d.stride(0), num_vtiles, inv_temp,
            ENTROPY_BONUS=bonus, BLOCK_R=block_r, BLOCK_V=cfg["BLOCK_V"],
        )
        if grad_hidden is not None:
            _split_k(d, w, splits.view(-1)[: splits.shape[0] * m * h].view(-1, m, h), grad_hidden[t0:t1], dx,
                     k_split)
        _matmul(d.t(), rows[t0:t1], main_grad, accumulate=True, gemm=cfg["DW"])


def _main_grad_forward(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight,
                       cfg: PolicyLossConfig, main_grad, need_hidden):
    """(terms, dhidden or None) of the main-grad mode: the lean mode's per-token terms, bit for bit, with dW
    added into main_grad and dhidden [N,H] (compute dtype) formed on the way.

    ppo: the statistics and terms of each token chunk come from its one logits pass (3 GEMMs). gspo: a token's
    ratio needs its whole sequence's logp, which a chunk may not hold: the lean statistics first, then the chunk
    pass with the terms known (4 GEMMs, as the lean mode)."""
    h = hidden.shape[-1]
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    rows = hidden.reshape(-1, h).to(dtype)
    w = weight.to(dtype)
    targets = _flat(target_ids)
    cfg_run = config(dtype)
    n = rows.shape[0]
    f32 = dict(dtype=torch.float32, device=rows.device)
    bonus = cfg.entropy_coef > 0
    grad_hidden = torch.empty(n, h, dtype=dtype, device=rows.device) if need_hidden else None
    if cfg.policy_loss == "gspo":
        terms = _policy_terms(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight,
                              cfg)
        stats = (terms["logp"], terms["lse"], terms["mean_z"], False)

        def coefficients(t0, t1):
            return terms["dlogp"][t0:t1], terms["dent"][t0:t1]
    else:
        per_token = torch.empty(9, n, **f32)
        logp, lse, mean_z, *rest = per_token
        mean_z = mean_z if cfg.needs_entropy else None
        terms = dict(zip(("loss", "dlogp", "dent", "clipped", "clipped_lower", "kl"), rest, strict=True))
        if ref_logprobs is None:
            terms["kl"] = None
        old, adv, weights = (_flat(t, torch.float32) for t in (old_logprobs, advantages, token_weight))
        ref = None if ref_logprobs is None else _flat(ref_logprobs, torch.float32)
        terms.update(logp=logp, lse=lse, mean_z=mean_z)
        stats = (logp, lse, mean_z, True)

        def coefficients(t0, t1):
            at = slice(t0, t1)
            _token_terms(logp[at], lse[at], None if mean_z is None else mean_z[at], old[at],
                         None if ref is None else ref[at], adv[at], weights[at], None, cfg,
                         out={k: None if terms[k] is None else terms[k][at]
                              for k in ("loss", "dlogp", "dent", "clipped", "clipped_lower", "kl")})
            return terms["dlogp"][at], terms["dent"][at]
    if n:
        _main_grad_pass(rows, w, targets, 1.0 / cfg.temperature, cfg_run, main_grad, grad_hidden, stats,
                        coefficients, cfg.needs_entropy and stats[3], bonus)
    terms.update(rows=rows, w=w, targets=targets, run_config=cfg_run)
    return terms, grad_hidden


class _MainGradLossFunction(torch.autograd.Function):
    """The fp32 main-grad mode, 3 GEMMs: the forward runs the token-chunk pass (`_main_grad_pass`), which adds
    dL/dW for an upstream of 1 into the caller's fp32 `main_grad` [V,H] (Megatron's main_grad) in fixed
    token-chunk order and forms dhidden; the weight gets no .grad, and no [V,H] gradient in the weight's dtype
    nor fp32 scratch exists. Backward scales dhidden in place by the upstream g (as the lean mode) and, for
    g != 1 only (one host read of g), adds (g - 1) dW with a second pass (the logits and dW GEMMs again).
    Not a torch custom op (torch.compile breaks the graph here)."""

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight, cfg,
                main_grad):
        terms, grad_hidden = _main_grad_forward(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs,
                                                mask, token_weight, cfg, main_grad, ctx.needs_input_grad[0])
        bonus = cfg.entropy_coef > 0
        ctx.save_for_backward(grad_hidden, terms["rows"], terms["w"], terms["targets"], terms["lse"],
                              terms["mean_z"] if cfg.needs_entropy else None, terms["dlogp"],
                              terms["dent"] if bonus else None)
        ctx.cfg, ctx.run_config, ctx.main_grad = cfg, terms["run_config"], main_grad
        ctx.shapes = (hidden.shape, hidden.dtype)
        lead = hidden.shape[:-1]
        empty = terms["logp"].new_empty(0)
        kl = terms["kl"].reshape(lead) if terms["kl"] is not None else empty.clone()
        entropy = (terms["lse"] - terms["mean_z"]).reshape(lead) if cfg.needs_entropy else empty.clone()
        outs = (terms["logp"].reshape(lead), terms["clipped"].reshape(lead), terms["clipped_lower"].reshape(lead),
                kl, entropy)
        ctx.mark_non_differentiable(*outs)
        return (terms["loss"].sum(), *outs)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_hidden, rows, w, targets, lse, mean_z, dlogp, dent = ctx.saved_tensors
        hidden_shape, hidden_dtype = ctx.shapes
        g = grad_loss.to(torch.float32)
        if grad_hidden is not None:
            scale_gradient_(grad_hidden, g)
        if rows.shape[0]:
            scale = float(g)  # the forward added dW for an upstream of 1
            if scale != 1.0:
                cfg = ctx.cfg
                _main_grad_pass(rows, w, targets, 1.0 / cfg.temperature, ctx.run_config, ctx.main_grad, None,
                                (None, lse, mean_z, False),
                                lambda t0, t1: ((scale - 1.0) * dlogp[t0:t1],
                                                None if dent is None else (scale - 1.0) * dent[t0:t1]),
                                False, dent is not None)
        if not ctx.needs_input_grad[0]:
            return (None,) * 10
        grad = (torch.zeros(hidden_shape, dtype=hidden_dtype, device=rows.device) if grad_hidden is None
                else grad_hidden.reshape(hidden_shape).to(hidden_dtype))
        return (grad,) + (None,) * 9


class _TokenLossFunction(torch.autograd.Function):
    """Per-token losses m_t l_t [B,T] for the harness: any upstream g_t, so the gradient is recomputed in
    backward with coefficients g_t a_t, g_t b_t through the same kernels as the fused loss."""

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, cfg):
        terms = _policy_terms(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, mask, cfg)
        ctx.save_for_backward(terms["rows"], terms["w"], terms["targets"], terms["lse"],
                              terms["mean_z"] if cfg.entropy_coef > 0 else None, terms["dlogp"], terms["dent"])
        ctx.cfg, ctx.run_config = cfg, terms["run_config"]
        ctx.shapes = (hidden.shape, hidden.dtype, weight.dtype)
        return terms["loss"].reshape(hidden.shape[:-1])

    @staticmethod
    def backward(ctx, grad_loss):
        rows, w, targets, lse, mean_z, dlogp, dent = ctx.saved_tensors
        hidden_shape, hidden_dtype, weight_dtype = ctx.shapes
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if rows.shape[0] == 0:
            grad_hidden = torch.zeros(hidden_shape, dtype=torch.float32, device=rows.device)
            grad_weight = torch.zeros_like(w)
        else:
            g = _flat(grad_loss, torch.float32)
            bonus = ctx.cfg.entropy_coef > 0
            grad_hidden, grad_weight = _gradients(rows, w, targets, lse, mean_z, g * dlogp, g * dent if bonus else None,
                                                  1.0 / ctx.cfg.temperature, ctx.run_config, need_hidden, need_weight)
        grad_hidden = grad_hidden.reshape(hidden_shape).to(hidden_dtype) if need_hidden else None
        grad_weight = grad_weight.to(weight_dtype) if need_weight else None
        return grad_hidden, grad_weight, None, None, None, None, None, None


class TritonLinearPolicyLossOp:
    """Triton candidate for NativeLinearPolicyLossOp: the masked per-token losses [B,T]."""

    input_names = NativeLinearPolicyLossOp.input_names

    def __init__(self, cfg: PolicyLossConfig = HARNESS_CONFIG):
        self.cfg = cfg

    def __call__(self, *, hidden, lm_head_weight, target_ids, advantages, old_logprobs, ref_logprobs, mask):
        check_devices("TritonLinearPolicyLossOp", hidden=hidden, lm_head_weight=lm_head_weight, target_ids=target_ids,
                      advantages=advantages, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask)
        NativeLinearPolicyLossOp(self.cfg).validate(
            hidden=hidden, lm_head_weight=lm_head_weight, target_ids=target_ids, advantages=advantages,
            old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, mask=mask,
        )
        return _TokenLossFunction.apply(hidden, lm_head_weight, target_ids, advantages, old_logprobs, ref_logprobs,
                                        mask, self.cfg)
