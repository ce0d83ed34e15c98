"""The interpreter runs code a GPU compiler refuses (e.g. a jit function reading a non-constexpr global):
compile the policy-loss kernels that carry the gold's constants for sm_90, on the CPU (no GPU needed)."""

import pytest
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

from rl_engine.kernels.ops.triton.loss import linear_policy_loss as ops


@pytest.fixture(autouse=True)
def _the_compiler_not_the_interpreter(monkeypatch):
    # Triton >= 3.7 reads TRITON_INTERPRET while it builds: with it set, the GPU compile takes interpreter paths.
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _compile(kernel, floats, constexprs):
    fn = JITFunction(getattr(kernel, "fn", kernel))  # under TRITON_INTERPRET the decorator wraps it
    signature = {name: ("constexpr" if name in constexprs else "*fp32" if name.endswith("_ptr") else
                        "fp32" if name in floats else "i32") for name in fn.arg_names}
    return compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))


@pytest.mark.parametrize("gspo", [False, True], ids=["ppo", "gspo"])
def test_token_terms_kernel_compiles_for_sm90(gspo):
    floats = ("clip_lo", "clip_hi", "clip_c", "kl_coef", "entropy_coef")
    kernel = _compile(ops._token_terms_kernel, floats, dict(GSPO=gspo, HAS_REF=True, ENTROPY_BONUS=True, BLOCK=1024))
    assert "ptx" in kernel.asm


def test_seq_sum_kernel_compiles_for_sm90():
    assert "ptx" in _compile(ops._seq_sum_kernel, (), dict(BLOCK=256)).asm
