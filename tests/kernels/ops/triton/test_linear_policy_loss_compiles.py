"""The interpreter runs code a GPU compiler refuses (e.g. a jit function reading a non-constexpr global):
compile the policy-loss kernels that carry the gold's constants for sm_90, on the CPU (no GPU needed).

The compile runs in a child process with TRITON_INTERPRET=0 (without CUDA the kernel package would otherwise
choose the interpreter): Triton >= 3.7 reads that setting while it builds and imports, so a process that
interprets cannot also compile."""

import os
import subprocess
import sys


def _compile(kernel, floats, constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    fn = JITFunction(getattr(kernel, "fn", kernel))
    signature = {name: ("constexpr" if name in constexprs else "*fp32" if name.endswith("_ptr") else
                        "fp32" if name in floats else "i32") for name in fn.arg_names}
    return compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))


def compile_all() -> None:
    from rl_engine.kernels.ops.triton.loss import linear_policy_loss as ops

    floats = ("clip_lo", "clip_hi", "clip_c", "kl_coef", "entropy_coef")
    for gspo in (False, True):
        kernel = _compile(ops._token_terms_kernel, floats,
                          dict(GSPO=gspo, HAS_REF=True, ENTROPY_BONUS=True, BLOCK=1024))
        assert "ptx" in kernel.asm, f"token terms (gspo={gspo}): no PTX"
    assert "ptx" in _compile(ops._seq_sum_kernel, (), dict(BLOCK=256)).asm, "seq sum: no PTX"


def test_policy_loss_kernels_compile_for_sm90():
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__)))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    child = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]


if __name__ == "__main__":
    compile_all()
