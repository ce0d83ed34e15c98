"""benchmarks/tp_decoder.py on gloo at a tiny dense config (Triton interpreter): the ranks' and the single
model's results compared bitwise, every code path but NCCL and the CUDA timing."""

import sys
from pathlib import Path

from rl_engine.models.config import ModelConfig

CONFIG = ModelConfig("tp_tiny", "qwen3", 128, 64, 128, 1, 4, 2, 16)


def test_tp_two_ranks_equal_the_single_model_and_report_both_times():
    # The spawned ranks import the script by its module name.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import tp_decoder

    row = tp_decoder.run(CONFIG, 2, 2, 2, 1, "gloo", "cpu")
    assert row["passed"], row["bitwise"]
    assert set(row["bitwise"]) == {"logp", "grad_embeds", "logp_1row", "grad_embeds_1row", "1row_is_row0"}
    assert len(row["tp_rank_ms"]) == 2 and row["single_ms"] > 0
