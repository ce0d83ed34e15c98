"""The library's entry points from a plain shell: conftest exports TRITON_INTERPRET for every test, a user's shell
does not. Without CUDA the kernel packages must choose Triton's interpreter themselves, before any kernel loads."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import torch, transformers
from rl_engine.integrations.transformers import patch, selected_logprobs
from rl_engine.flash_attn import flash_attn_func
cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16)
torch.manual_seed(0)
model = transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16)
patch(model, profile="triton_bf16")
logp = selected_logprobs(model, torch.randint(0, 64, (2, 5)))
q = torch.randn(1, 4, 2, 16, dtype=torch.bfloat16)
out = flash_attn_func(q, q, q, causal=True)
print("ok", tuple(logp.shape), bool(torch.isfinite(logp).all()), tuple(out.shape))
"""


def _run(env_update: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_update)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_patch_and_flash_attn_run_from_a_plain_shell():
    result = _run({})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ok", "(2,", "4)", "True", "(1,", "4,", "2,", "16)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is chosen only without CUDA")
def test_an_exported_choice_wins_and_the_check_sees_it():
    # Planted: the user's own TRITON_INTERPRET=0 is kept, so the same script fails on a CPU: the test above
    # would catch a library that stopped choosing the interpreter.
    assert _run({"TRITON_INTERPRET": "0"}).returncode != 0


def test_a_candidate_module_in_the_working_directory_imports_from_the_console_script(tmp_path):
    # The console script's sys.path lacks the working directory (python -m would add it, so run the script itself).
    (tmp_path / "my_kernels.py").write_text(
        "import torch\n\ndef my_logp(logits, target_ids, **kw):\n"
        "    return torch.log_softmax(logits.float(), -1).gather(-1, target_ids[..., None])[..., 0]\n")
    script = os.path.join(os.path.dirname(sys.executable), "rl-engine")
    result = subprocess.run([script, "check-op", "--op", "logp", "--candidate", "my_kernels:my_logp", "--device", "cpu",
                             "--dtype", "fp32", "--batch", "1", "--seq", "2", "--vocab", "17"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "candidate=my_kernels:my_logp backend=external passed=True" in result.stdout
