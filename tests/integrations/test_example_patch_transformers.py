"""examples/patch_transformers.py (the README's "Use it in your trainer") runs and prints what the README shows.

Under reference_fp32 (plain torch, fast) the patched model computes what the unpatched fp32 transformers model
computes; the triton_bf16 run of the README (16 s under the interpreter) is left to the other tests here."""

import importlib.util
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "examples" / "patch_transformers.py"


def test_example_runs(capsys):
    spec = importlib.util.spec_from_file_location("patch_transformers_example", PATH)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--profile", "reference_fp32"]) == 0
    printed = capsys.readouterr().out
    for line in ("max|Δ| vs unpatched transformers fp32", "bitwise alone = left-padded", "grad_norm=", "generate: ["):
        assert line in printed
    r = example.run("reference_fp32")
    assert r["max_diff"] < 1e-5 and r["grad_norm"] > 0 and len(r["new_tokens"]) == 4
