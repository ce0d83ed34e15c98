"""The Triton sampler kernel (one program per row): its filters against the torch path and the fp64
reference, its draw against the torch path's and against softmax, greedy, NaN/inf rows, and the
independence of a row's token from its batch. CPU runs use Triton's interpreter at tiny V."""

import math

import pytest
import torch

from rl_engine.kernels.ops.triton.sampling.sampler import sample_tokens
from rl_engine.rollout.sampling import (
    SamplingParams,
    check_tokens,
    keep_mask,
    sample,
    sample_reference,
    sampling_tensors,
)
from tests.rollout.test_sampling import CASES, reference_keep

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def kernel(logits, params, ids, positions, keep=None):
    return sample_tokens(logits, *sampling_tensors(params, ids, positions, logits.device), keep=keep)


def kernel_keep(z_rows, params):
    """int8 [B,V] survivors from the kernel (temperature 1, so z = logits)."""
    keep = torch.zeros(z_rows.shape, dtype=torch.int8, device=z_rows.device)
    kernel(z_rows, params, list(range(len(params))), [0] * len(params), keep)
    return keep.bool().cpu()


def test_filters_match_the_torch_path_and_the_fp64_reference():
    # V = 40 crosses a block border under the interpreter (BLOCK 32) and has a tail.
    g = torch.Generator().manual_seed(7)
    params = [SamplingParams(**case) for case in CASES for _ in range(2)]
    z = torch.randn(len(params), 40, generator=g) * 2
    got = kernel_keep(z.to(DEVICE), params)
    for b, p in enumerate(params):
        case = CASES[b // 2]
        assert torch.equal(got[b], keep_mask(z[b], p)), (b, case)
        assert torch.equal(got[b], reference_keep(z[b], **case)), (b, case)


def test_ties_at_the_top_k_value_and_at_the_top_p_cut():
    # top-k 2 on [3, 2, 2, 2, 0]: every 2 ties the 2nd value and stays. top-p: four equal tokens hold
    # 0.25 each; top_p 0.6 keeps the first three in id order (mass before: 0, 0.25, 0.5 < 0.6; 0.75 not).
    rows = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0, -1e9], [1.0, 5.0, 5.0, 5.0, 5.0, -1e9]])
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6)]
    got = kernel_keep(rows.to(DEVICE), params)
    assert got[0].tolist() == [True, True, True, True, False, False]
    assert got[1].tolist() == [False, True, True, True, False, False]
    for b, p in enumerate(params):
        assert torch.equal(got[b], keep_mask(rows[b], p))


def test_min_p_comes_before_top_p():
    # test_sampling's order case: vLLM's order keeps one token, HF's would keep two.
    z = torch.tensor([[0.0, 0.0] + [-3.0] * 10, [0.0, 0.0] + [-3.0] * 10])
    got = kernel_keep(z.to(DEVICE), [SamplingParams(min_p=0.1, top_p=0.45), SamplingParams(top_p=0.45)])
    assert got[0].tolist() == [True] + [False] * 11
    assert got[1].tolist() == [True, True] + [False] * 10


def test_draws_match_the_fp64_torch_path():
    # The same rule in torch (fp64 Gumbel, libm log) and in the kernel (fp64, libdevice or numpy log): the
    # tokens may differ only where the two best scores are within a few ulps; count such rows, and bound them.
    g = torch.Generator().manual_seed(3)
    n, v = 48, 40
    logits = torch.randn(n, v, generator=g) * 2
    params = [SamplingParams(temperature=(0.5, 1.0, 1.7)[i % 3], min_p=0.02 if i % 4 == 0 else 0.0, seed=i // 5)
              for i in range(n)]
    ids, positions = [1000 + i for i in range(n)], [(7 * i) % 13 for i in range(n)]
    got = kernel(logits.to(DEVICE), params, ids, positions).cpu()
    want = sample_reference(logits, params, ids, positions)
    close = 0
    for b in torch.nonzero(got != want).flatten().tolist():
        z = logits[b].float() / params[b].temperature
        from rl_engine.rollout.sampling import uniforms

        score = torch.where(keep_mask(z, params[b]), z.double() - torch.log(-torch.log(
            uniforms(params[b].seed, ids[b], positions[b], v))), -math.inf)
        top2 = torch.topk(score, 2).values
        assert float(top2[0] - top2[1]) <= 4 * math.ulp(float(top2[0])), (b, got[b], want[b], top2)
        close += 1
    assert close <= 1, close  # a near-tie of fp64 scores is rare: more than one in 48 rows is a bug


@pytest.mark.parametrize("n", [pytest.param(240, id="cpu-240"), pytest.param(60000, id="gpu-60000",
                                                                         marks=pytest.mark.gpu)])
def test_draws_follow_softmax_over_the_survivors(n):
    # n draws of one sequence, the position as counter; min-p 0.05 removes token 3 (ratio e^-8). Chi-square
    # over the 3 survivors (2 degrees of freedom): a correct sampler exceeds 18.4 with probability 1e-4 (the
    # draws are fixed, so the test is deterministic; this bounds how unlucky the fixed seed may be), while
    # temperature ignored (T 1 instead of 0.5) expects ~0.11 n + 2: 28 at n = 240. The CPU size is small
    # (the interpreter runs a program in ~10 ms); the GPU size resolves probabilities to ~0.5%.
    logits = torch.tensor([1.0, 0.5, 0.0, -3.0]).repeat(n, 1)
    params = [SamplingParams(temperature=0.5, min_p=0.05, seed=11)] * n
    draws = kernel(logits.to(DEVICE), params, [5] * n, list(range(n))).cpu()
    counts = torch.bincount(draws, minlength=4).double()
    assert counts[3] == 0 and counts.sum() == n
    def chi2(t):
        expected = n * torch.softmax(torch.tensor([1.0, 0.5, 0.0]).double() / t, 0)
        return float(((counts[:3] - expected) ** 2 / expected).sum())
    assert chi2(0.5) < 18.4, (counts, chi2(0.5))
    assert chi2(1.0) > 18.4  # the test can tell T = 1 from T = 0.5


def test_greedy_is_the_first_argmax_of_the_raw_logits():
    rows = torch.tensor([[0.5, 3.0, 3.0, -1.0] + [-5.0] * 36, [0.0] * 33 + [2.0, 9.0, 9.0] + [0.0] * 4,
                         [float("-inf")] * 39 + [float("inf")]], dtype=torch.bfloat16)
    got = kernel(rows.to(DEVICE), [SamplingParams(temperature=0.0)] * 3, [0, 1, 2], [0, 0, 0]).tolist()
    assert got == [1, 34, 39]


@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")  # 1e38 / 0.1, on purpose
def test_nan_and_inf_rows_give_no_token():
    nan, inf = float("nan"), float("inf")
    base = [0.0, 1.0, 2.0, 3.0] * 10
    rows = torch.tensor([base[:5] + [nan] + base[6:],  # a NaN: sampled
                         base[:5] + [nan] + base[6:],  # a NaN: greedy
                         [-inf] * 40,  # nothing above -inf: sampled
                         [-inf] * 40,  # greedy
                         base[:7] + [inf] + base[8:],  # +inf: sampled
                         base[:7] + [inf] + base[8:],  # +inf: greedy takes it
                         [1e38] + [0.0] * 39,  # 1e38 / 0.1 overflows to +inf
                         [-inf] * 10 + [1.0] + [-inf] * 29])  # one finite logit: drawn
    temps = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.1, 1.0]
    params = [SamplingParams(temperature=t, top_k=3 if i == 7 else 0) for i, t in enumerate(temps)]
    ids, positions = list(range(8)), [3] * 8
    want = [-1, -1, -1, -1, -1, 7, -1, 10]
    assert kernel(rows.to(DEVICE), params, ids, positions).tolist() == want
    assert sample_reference(rows, params, ids, positions).tolist() == want
    with pytest.raises(ValueError, match="request 0: its logits hold NaN"):
        check_tokens(want, ids)
    check_tokens([5, 7], [1, 2])


def assert_rows_invariant(sampler, logits, params, ids, positions):
    """Every row's token equals its token alone and inside a permuted batch."""
    batch = sampler(logits, params, ids, positions)
    order = list(reversed(range(len(params))))
    permuted = sampler(logits[order], [params[i] for i in order], [ids[i] for i in order],
                       [positions[i] for i in order])
    assert torch.equal(permuted, batch[order]), (permuted, batch[order])
    for b in range(len(params)):
        alone = sampler(logits[b : b + 1], params[b : b + 1], ids[b : b + 1], positions[b : b + 1])
        assert int(alone[0]) == int(batch[b]), b


def _batch(n, v, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(n, v, generator=g) * 2).to(device, dtype)
    params = [SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, top_k=5 if i % 3 == 0 else 0, seed=2)
              for i in range(n)]
    return logits, params, [10 + i for i in range(n)], [3 + i % 2 for i in range(n)]


def test_a_row_draws_the_same_alone_and_in_any_batch():
    assert_rows_invariant(kernel, *_batch(4, 40, DEVICE))


def test_a_draw_keyed_by_the_batch_row_is_caught():
    def by_row(logits, params, ids, positions):  # a planted bug: the draw sees the row's place in the batch
        return kernel(logits, params, list(range(len(ids))), positions)

    logits, params, ids, positions = _batch(4, 40, DEVICE)
    params = [SamplingParams(temperature=5.0, seed=2)] * 4  # a flat distribution: another key, another token
    with pytest.raises(AssertionError):
        assert_rows_invariant(by_row, logits, params, ids, positions)


def test_the_custom_op_gives_the_kernel_tokens():
    logits, _, ids, positions = _batch(3, 40, DEVICE)
    tensors = sampling_tensors([SamplingParams(temperature=0.9, seed=2)] * 3, ids, positions, DEVICE)
    assert torch.equal(torch.ops.rl_engine.sample_tokens(logits, *tensors), sample_tokens(logits, *tensors))


def test_sample_takes_the_kernel_on_cuda_and_the_torch_path_elsewhere():
    logits, params, ids, positions = _batch(3, 40, "cpu")
    assert torch.equal(sample(logits, params, ids, positions), sample_reference(logits, params, ids, positions))
    with pytest.raises(ValueError, match="sequence_ids"):
        sample(logits, params, [2**63, 1, 2], positions)
    with pytest.raises(ValueError, match="top_k"):
        t = list(sampling_tensors(params, ids, positions, "cpu"))
        t[1] = t[1].int()
        sample_tokens(logits, *t)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64, 256])
def test_gpu_qwen3_vocab_rows_are_batch_invariant(batch):
    # V = 151936 (Qwen3), bf16: each row's token alone equals its token in the batch, and in a batch of
    # another size (the row moved to another program id).
    logits, params, ids, positions = _batch(batch, 151936, "cuda", torch.bfloat16)
    params = [SamplingParams(temperature=0.8, top_k=(0, 50)[i % 2], top_p=(1.0, 0.9, 0.95)[i % 3],
                             min_p=0.05 if i % 5 == 0 else 0.0, seed=i % 3) for i in range(batch)]
    whole = kernel(logits, params, ids, positions)
    assert (whole >= 0).all()
    for b in range(batch):
        alone = kernel(logits[b : b + 1], params[b : b + 1], ids[b : b + 1], positions[b : b + 1])
        assert int(alone[0]) == int(whole[b]), b
    padded = torch.cat([logits[:1], logits])  # every row one program id later
    shifted = kernel(padded, params[:1] + params, ids[:1] + ids, positions[:1] + positions)
    assert torch.equal(shifted[1:], whole)
    # The torch path draws the same tokens but at boundaries of rounding (a handful at most).
    assert int((sample_reference(logits, params, ids, positions) != whole).sum()) <= max(1, batch // 32)
