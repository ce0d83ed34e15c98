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
known ([TOKEN_CHUNK, V]) or dW accumulated in fp32 across token chunks ([V, H] fp32): both far above
the memory goal. H200, N = 4096 / 8192, H = 4096, V = 151936: 4.38x / 4.51x a cuBLAS GEMM of the
logits' shape, 67 / 168 MB working memory (benchmarks/results/policy_loss.json).

fp32 main-grad mode (`main_grad=`, `_MainGradLossFunction`): the forward runs passes 1-3 only; the backward
runs pass 4 with the upstream folded into a_t, b_t, and dW goes into the caller's fp32 [V,H] buffer
(main_grad += dlogits^T @ hidden, token chunks in order, no scratch, no weight-dtype gradient). Same
loss, logp and metric bits; the same 4 GEMMs of work (the 3-GEMM form is not built).
"""

from __future__ import annotations

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
    _grouped_tile,
    _logits_tile,
    _matmul,
    _tile_options,
    backward_chunk,
    num_programs,
    tma_descriptor,
)
from rl_engine.kernels.ops.triton.loss.linear_logp import config as _linear_logp_config
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


def config(dtype: torch.dtype) -> dict:
    """linear_logp's tiles and vocabulary chunk, with this op's token chunk and sequence lanes."""
    key = "interpreter" if interpreting() else "gpu"
    return dict(_linear_logp_config(dtype), TOKEN_CHUNK=TOKEN_CHUNK[key], SEQ_BLOCK=SEQ_BLOCK[key])


@triton.jit(do_not_specialize=["N"])
def _stats_partials_kernel(
    h_desc, w_desc, target_ptr, part_max_ptr, part_sum_ptr, part_zsum_ptr, target_logit_ptr,
    N, V, H, inv_temp, num_vtiles,
    ENTROPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
    GROUP: tl.constexpr, NUM_PROGRAMS: tl.constexpr, DOT_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # Persistent over the tiles, as linear_logp's partials (same logits tiles, same K order).
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
            part_max, part_sum, part_zsum, target_logit, m, v, h, inv_temp, num_vtiles,
            ENTROPY=entropy, NUM_PROGRAMS=programs, **_tile_options(cfg, rows.dtype),
        )
        _stats_combine_kernel[(m,)](
            part_max, part_sum, part_zsum, target_logit, logp[t0:t1], lse[t0:t1], mean_z[t0:t1], num_vtiles,
            ENTROPY=entropy, BLOCK=triton.next_power_of_2(num_vtiles), num_warps=1 if interpreting() else 4,
        )
    return logp, lse, (mean_z if entropy else None)


def _gradients(rows, w, targets, lse, mean_z, a, b, inv_temp, cfg, need_hidden, need_weight, main_grad=None):
    """fp32 dhidden [N,H] and dW [V,H] (weight dtype) for per-token coefficients a = dL/dlogp, b = dL/dH.

    main_grad: an fp32 [V,H] buffer dW is added into (main_grad += dW, token chunks in order), returned
    in place of dW: no weight-dtype gradient and no scratch."""
    n, h = rows.shape
    v = w.shape[0]
    tc = cfg["TOKEN_CHUNK"]
    vc = backward_chunk(cfg, min(tc, n))  # wider only for a batch shorter than one token chunk
    bonus = b is not None
    dlogits = torch.empty(min(tc, n), min(vc, v), dtype=rows.dtype, device=rows.device)
    grad_hidden = torch.zeros(n, h, dtype=torch.float32, device=rows.device) if need_hidden else None
    grad_weight = torch.empty_like(w) if need_weight and main_grad is None else None
    # dW sums over token chunks in fp32, in chunk order; fp32 weights accumulate in place.
    scratch = None
    if need_weight and main_grad is None and w.dtype != torch.float32 and n > tc:  # one chunk: one rounding
        scratch = torch.empty(min(vc, v), h, dtype=torch.float32, device=rows.device)
    w_desc = tma_descriptor(w, [cfg["BLOCK_V"], cfg["BLOCK_H"]])
    h_descs = [tma_descriptor(rows[t0:t0 + tc], [cfg["BLOCK_T"], cfg["BLOCK_H"]]) for t0 in range(0, n, tc)]
    programs = num_programs(rows.device)
    for v0 in range(0, v, vc):
        v1 = min(v0 + vc, v)
        dw = None
        if need_weight:
            dw = main_grad if main_grad is not None else grad_weight if scratch is None else None
            dw = dw[v0:v1] if dw is not None else scratch[: v1 - v0]
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
                _matmul(d.t(), rows[t0:t1], dw, accumulate=t0 > 0 or main_grad is not None, gemm=cfg["DW"])
        if scratch is not None:
            grad_weight[v0:v1].copy_(dw)  # one round-to-nearest-even cast per element
    return grad_hidden, (main_grad if main_grad is not None else grad_weight)


def _token_terms(logp, lse, mean_z, old, ref, adv, weight, seq, cfg: PolicyLossConfig) -> dict:
    n = logp.shape[0]
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
    main_grad: the fp32 main-grad mode (`_MainGradLossFunction`); the loss, logp and metrics bits are the
    lean mode's.
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
    if main_grad is not None:
        loss, logp, clipped, lower, kl, entropy = _MainGradLossFunction.apply(
            hidden, lm_head_weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight, cfg,
            main_grad if need_weight else None)
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


class _MainGradLossFunction(torch.autograd.Function):
    """The fp32 main-grad mode: the forward computes the statistics and per-token terms only (the loss,
    logp and metric bits of the lean mode); the backward recomputes each logits piece, with the upstream
    folded into the coefficients (g a_t, g b_t), forms dhidden, and adds dW into the caller's fp32
    `main_grad` [V,H] in fixed token-chunk order (Megatron's main_grad): the weight gets no .grad, and
    no [V,H] gradient in the weight's dtype nor fp32 scratch exists. Work: 4 GEMMs, as the lean mode;
    not a torch custom op (torch.compile breaks the graph here)."""

    @staticmethod
    def forward(ctx, hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask, token_weight, cfg,
                main_grad):
        terms = _policy_terms(hidden, weight, target_ids, advantages, old_logprobs, ref_logprobs, mask,
                              token_weight, cfg)
        ctx.save_for_backward(terms["rows"], terms["w"], terms["targets"], terms["lse"],
                              terms["mean_z"] if cfg.entropy_coef > 0 else None, terms["dlogp"], terms["dent"])
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
        rows, w, targets, lse, mean_z, dlogp, dent = ctx.saved_tensors
        hidden_shape, hidden_dtype = ctx.shapes
        need_hidden = ctx.needs_input_grad[0]
        main_grad = ctx.main_grad
        grad_hidden = None
        if rows.shape[0] and (need_hidden or main_grad is not None):
            g = grad_loss.to(torch.float32)
            bonus = ctx.cfg.entropy_coef > 0
            grad_hidden, _ = _gradients(rows, w, targets, lse, mean_z, g * dlogp, g * dent if bonus else None,
                                        1.0 / ctx.cfg.temperature, ctx.run_config, need_hidden,
                                        main_grad is not None, main_grad=main_grad)
        if need_hidden:
            grad_hidden = (torch.zeros(hidden_shape, dtype=hidden_dtype, device=rows.device) if grad_hidden is None
                           else grad_hidden.reshape(hidden_shape).to(hidden_dtype))
        return grad_hidden, None, None, None, None, None, None, None, None, None


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
