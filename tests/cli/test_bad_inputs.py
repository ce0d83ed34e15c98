"""Every subcommand and the public API, driven with bad inputs: exit 2 (or the documented exception),
exactly one line naming the input, no traceback, no work done, nothing written.

Rows run in-process through cli.main (argparse errors arrive as SystemExit). Placeholders in the
arguments are files made per test: BADJSON (not JSON), LIST (a JSON list), FILE (a regular file,
so FILE/x.json has a parent that is not a directory), DIR (an existing directory), PIPE_FILE (a named
pipe), DEVNULL (/dev/null), NULL_LINK (a symlink to /dev/null), DIR_LINK (a symlink to DIR), CKPT
(a checkpoint directory: config.json and model.safetensors), copies of the packaged CONTRACT, GOLDEN
and MANIFEST, PROVIDER_MOD / CANDIDATE_MOD (importable modules in the test's directory, whose source
files are PROVIDER_SRC / CANDIDATE_SRC), and the rest below. Every file under the test's directory
is the same after the run as before it (an output refused before the work writes nothing).
"""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from rl_engine import cli
from rl_engine.errors import UsageError

REFERENCE = "rl_engine.mhc.provider:ReferenceProvider"

# (command, arguments, what the one line must contain[, pytest marks]). Broken checkpoint files
# (config.json, safetensors) have their own table in tests/models/test_hf_checkpoint.py.
ROWS = {
    # no or unknown command
    "no command": ("", [], "a command is required"),
    "unknown command": ("", ["nope"], "invalid choice: 'nope'"),
    "unknown flag": ("check-op", ["--op", "logp", "--bogus"], "unrecognized arguments: --bogus"),
    # check-op
    "op: unknown op": ("check-op", ["--op", "conv"], "unknown op 'conv'"),
    "op: missing op": ("check-op", [], "--op is required"),
    "op: zero size": ("check-op", ["--op", "logp", "--seq", "0"], "--seq: expected a positive integer"),
    "op: negative size": ("check-op", ["--op", "logp", "--batch", "-3"], "--batch: expected a positive integer"),
    "op: size not a number": ("check-op", ["--op", "logp", "--batch", "x"], "invalid int value: 'x'"),
    "op: unknown dtype": ("check-op", ["--op", "logp", "--dtype", "fp8"], "unsupported dtype 'fp8'"),
    "op: unknown device": ("check-op", ["--op", "logp", "--device", "tpu"], "unknown device 'tpu'"),
    "op: unknown candidate": ("check-op", ["--op", "logp", "--candidate", "cuda"], "unknown candidate"),
    "op: layout the op lacks": ("check-op", ["--op", "attention", "--layout", "cached"],
                                "--layout cached: op attention takes padded, left_padded, packed"),
    "op: malformed contract": ("check-op", ["--op", "logp", "--contract", "BADJSON"], "not JSON"),
    "op: contract is a list": ("check-op", ["--op", "logp", "--contract", "LIST"], "expected a JSON object"),
    "op: json-out parent is a file": ("check-op", ["--op", "logp", "--json-out", "FILE/x.json"], "--json-out"),
    "op: json-out is a directory": ("check-op", ["--op", "logp", "--json-out", "DIR"], "is a directory"),
    # 8 x 10^13 fp32 logits: beyond any address space, so the allocator refuses at once, whatever the overcommit.
    "op: absurd vocab (out of memory)": ("check-op", ["--op", "logp", "--vocab", str(10**13)],
                                         "out of memory: tried to allocate 320000000000000 bytes"),
    "op: unknown arch key": ("check-op", ["--op", "logp", "--arch-key", "sm999"], "--arch-key"),
    "op: gradient of an op without one": ("check-op", ["--op", "kv_cache_attention", "--check-grad", "--batch", "1",
                                                       "--seq", "2"], "--check-grad"),
    # check-invariance
    "inv: unknown profile": ("check-invariance", ["--profile", "cuda_bf16"], "invalid choice: 'cuda_bf16'"),
    "inv: unknown model": ("check-invariance", ["--profile", "torch_bf16", "--model", "llama"], "invalid choice"),
    "inv: unknown device": ("check-invariance", ["--profile", "torch_bf16", "--device", "tpu"], "--device"),
    "inv: zero layers": ("check-invariance", ["--profile", "torch_bf16", "--layers", "0"], "--layers"),
    "inv: negative layers": ("check-invariance", ["--profile", "torch_bf16", "--layers", "-1"], "--layers"),
    "inv: missing manifest": ("check-invariance", ["--profile", "torch_bf16", "--manifest", "DIR/none.json"],
                              "cannot read"),
    "inv: malformed manifest": ("check-invariance", ["--profile", "torch_bf16", "--manifest", "BADJSON"],
                                "cannot read"),
    "inv: manifest is a list": ("check-invariance", ["--profile", "torch_bf16", "--manifest", "LIST"], "manifest"),
    "inv: malformed model config": ("check-invariance", ["--profile", "torch_bf16", "--weights-path", "CKPT_BADJSON"],
                                    "config.json"),
    "inv: model config is a list": ("check-invariance", ["--profile", "torch_bf16", "--weights-path", "CKPT_LIST"],
                                    "config.json"),
    "inv: out is a file": ("check-invariance", ["--profile", "torch_bf16", "--out", "FILE"], "--out"),
    "inv: json parent is a file": ("check-invariance", ["--profile", "torch_bf16", "--json", "FILE/x.json"], "--json"),
    # check-p1
    "p1: missing provider": ("check-p1", [], "--provider"),
    "p1: provider without a class": ("check-p1", ["--provider", "rl_engine.mhc.provider"], "module:Class"),
    "p1: nonexistent provider module": ("check-p1", ["--provider", "no_such_module_xyz:P"], "cannot import"),
    "p1: nonexistent provider attribute": ("check-p1", ["--provider", "rl_engine.mhc.provider:Nope"],
                                           "has no attribute 'Nope'"),
    "p1: unknown case": ("check-p1", ["--provider", REFERENCE, "--cases", "huge"], "unknown case(s) huge"),
    "p1: unknown device": ("check-p1", ["--provider", REFERENCE, "--device", "tpu"], "invalid choice: 'tpu'"),
    "p1: malformed golden": ("check-p1", ["--provider", REFERENCE, "--golden", "BADJSON"], "cannot read"),
    "p1: golden is a list": ("check-p1", ["--provider", REFERENCE, "--golden", "LIST"], "expected a JSON object"),
    "p1: corrupt golden": ("check-p1", ["--provider", REFERENCE, "--golden", "GOLDEN_CORRUPT"], "'one_row' needs"),
    "p1: golden cases a list": ("check-p1", ["--provider", REFERENCE, "--golden", "GOLDEN_CASES_LIST"],
                                "'cases' must be an object"),
    "p1: json parent is a file": ("check-p1", ["--provider", REFERENCE, "--json", "FILE/x.json"], "--json"),
    # check-tp
    "tp: zero and negative TP": ("check-tp", ["--world-sizes", "0,-1"], "--world-sizes"),
    "tp: TP not a number": ("check-tp", ["--world-sizes", "two"], "comma-separated integers"),
    "tp: TP without 1": ("check-tp", ["--world-sizes", "2"], "including 1"),
    "tp: unsupported TP": ("check-tp", ["--world-sizes", "1,3"], "--world-sizes"),
    "tp: unknown backend": ("check-tp", ["--backend", "mpi"], "invalid choice: 'mpi'"),
    "tp: backend on the wrong device": ("check-tp", ["--backend", "nccl"], "runs on --device cuda"),
    "tp: unknown preset": ("check-tp", ["--preset", "huge"], "invalid choice: 'huge'"),
    "tp: unknown device": ("check-tp", ["--device", "tpu"], "invalid choice: 'tpu'"),
    "tp: json parent is a file": ("check-tp", ["--json", "FILE/x.json"], "--json FILE/x.json"),
    # mhc-golden
    "golden: unknown case": ("mhc-golden", ["--cases", "huge"], "unknown case(s) huge"),
    "golden: unknown device": ("mhc-golden", ["--cases", "one_row", "--device", "tpu"], "--device"),
    "golden: malformed manifest": ("mhc-golden", ["--cases", "one_row", "--manifest", "BADJSON"], "cannot read"),
    "golden: manifest is a list": ("mhc-golden", ["--cases", "one_row", "--manifest", "LIST"],
                                   "expected a JSON object"),
    "golden: corrupt manifest": ("mhc-golden", ["--cases", "one_row", "--manifest", "GOLDEN_CORRUPT"],
                                 "'one_row' needs"),
    "golden: write over a malformed manifest": ("mhc-golden", ["--write", "--cases", "one_row", "--manifest",
                                                               "BADJSON"], "cannot read"),
    "golden: write where the parent is a file": ("mhc-golden", ["--write", "--cases", "one_row", "--manifest",
                                                                "FILE/x.json"], "--manifest"),
}

OP = ("check-op", ["--op", "logp"])
INV = ("check-invariance", ["--profile", "torch_bf16"])
P1 = ("check-p1", ["--provider", REFERENCE])


def _rows(base, table: dict) -> dict:
    command, prefix = base
    return {name: (command, [*prefix, *args], expected) for name, (args, expected) in table.items()}


# Fail loud II (#56): devices, seeds, non-finite or negative numbers, time limits, outputs onto inputs,
# onto non-regular files, and two outputs of one run on one path.
ROWS.update(_rows(OP, {
    "op: device meta": (["--device", "meta"], "--device meta: the checks run on cpu or cuda[:N] only"),
    "op: device cpu:3": (["--device", "cpu:3"], "--device cpu:3: the checks run on cpu or cuda[:N] only"),
    "op: device cuda:x": (["--device", "cuda:x"], "unknown device 'cuda:x'"),
    "op: grad seed 2**70": (["--grad-seed", str(2**70)],
                            f"--grad-seed: expected an integer in [0, 2**64), got {2**70}"),
    "op: seed 2**64": (["--seed", str(2**64)], "--seed: expected an integer in [0, 2**64)"),
    "op: negative seed": (["--seed", "-1"], "--seed: expected an integer in [0, 2**64), got -1"),
    "op: negative grad seed": (["--grad-seed", "-5"], "--grad-seed"),
    "op: seed not a number": (["--seed", "1.5"], "invalid int value: '1.5'"),
    "op: theta inf": (["--theta", "inf"], "--theta: expected a positive finite number, got inf"),
    "op: theta nan": (["--theta", "nan"], "--theta: expected a positive finite number, got nan"),
    "op: theta zero": (["--theta", "0"], "--theta"),
    "op: theta negative": (["--theta", "-1e4"], "--theta"),
    "op: eps inf": (["--eps", "inf"], "--eps: expected a non-negative finite number, got inf"),
    "op: eps nan": (["--eps", "nan"], "--eps"),
    "op: eps negative": (["--eps", "-1e-6"], "--eps"),
    "op: case timeout zero": (["--case-timeout", "0"], "--case-timeout must be a positive number of seconds, got 0"),
    "op: case timeout negative": (["--case-timeout", "-3"], "--case-timeout"),
    "op: case timeout nan": (["--case-timeout", "nan"], "--case-timeout"),
    "op: case timeout inf": (["--case-timeout", "inf"], "--case-timeout"),
    "op: case timeout not a number": (["--case-timeout", "soon"], "invalid float value: 'soon'"),
    "op: constant value nan": (["--input-mode", "constant", "--constant-value", "nan"],
                               "--constant-value: expected a finite number, got nan"),
    "op: constant value inf": (["--input-mode", "constant", "--constant-value", "inf"], "--constant-value"),
    "op: constant value -inf": (["--input-mode", "constant", "--constant-value", "-inf"], "--constant-value"),
    "op: negative token value": (["--token-value", "-1"], "--token-value: expected a non-negative id"),
    "op: unknown input mode": (["--input-mode", "zeros"], "--input-mode: expected random or constant"),
    "op: unknown grad mode": (["--grad-mode", "zeros"], "--grad-mode"),
    "op: heads not divisible": (["--n-heads", "4", "--n-kv-heads", "3"], "--n-kv-heads: 3 must divide"),
    "op: odd head dim": (["--head-dim", "7"], "--head-dim: rope needs an even head dim"),
    "op: qwen3-8b with a zero batch": (["--qwen3-8b", "--batch", "0"], "--batch"),
    "op: zero vocab": (["--vocab", "0"], "--vocab"),
    "op: candidate without a module": (["--candidate", ":logp"], "candidate must be 'module:attr'"),
    "op: contract is a directory": (["--contract", "DIR"], "DIR"),
    "op: missing contract": (["--contract", "DIR/none.json"], "none.json"),
    "op: json-out is a FIFO": (["--json-out", "PIPE_FILE"],
                               "--json-out PIPE_FILE: exists and is a FIFO, not a regular file"),
    "op: json-out is /dev/null": (["--json-out", "DEVNULL"], "exists and is a character device"),
    "op: json-out links to /dev/null": (["--json-out", "NULL_LINK"], "NULL_LINK: exists and is a character device"),
    "op: json-out links to a directory": (["--json-out", "DIR_LINK"], "--json-out DIR_LINK: is a directory"),
    "op: json-out onto the contract": (["--contract", "CONTRACT", "--json-out", "CONTRACT"],
                                       "--json-out CONTRACT: is --contract CONTRACT, an input of this run"),
    "op: json-out onto the candidate's source": (["--candidate", "CANDIDATE_MOD:logp", "--json-out", "CANDIDATE_SRC"],
                                                 "--json-out CANDIDATE_SRC: is --candidate's source"),
}))
ROWS.update(_rows(P1, {
    "p1: case timeout zero": (["--case-timeout", "0"], "--case-timeout must be a positive number of seconds"),
    "p1: case timeout negative": (["--case-timeout", "-1"], "--case-timeout"),
    "p1: case timeout nan": (["--case-timeout", "nan"], "--case-timeout"),
    "p1: case timeout inf": (["--case-timeout", "inf"], "--case-timeout"),
    "p1: device cpu:3": (["--device", "cpu:3"], "invalid choice: 'cpu:3'"),
    "p1: device meta": (["--device", "meta"], "invalid choice: 'meta'"),
    "p1: no case after --cases": (["--cases"], "expected at least one argument"),
    "p1: json is a FIFO": (["--json", "PIPE_FILE"], "--json PIPE_FILE: exists and is a FIFO"),
    "p1: json is /dev/null": (["--json", "DEVNULL"], "--json DEVNULL: exists and is a character device"),
    "p1: json links to /dev/null": (["--json", "NULL_LINK"], "exists and is a character device"),
    "p1: json is a directory": (["--json", "DIR"], "--json DIR: is a directory"),
    "p1: json links to a directory": (["--json", "DIR_LINK"], "is a directory"),
    "p1: json onto the golden manifest": (["--golden", "GOLDEN", "--json", "GOLDEN"],
                                          "--json GOLDEN: is --golden GOLDEN, an input of this run"),
}))
ROWS.update({
    "p1: provider without a module": ("check-p1", ["--provider", ":ReferenceProvider"], "module:Class"),
    "p1: provider without a class": ("check-p1", ["--provider", "rl_engine.mhc.provider:"], "module:Class"),
    "p1: json onto the provider's source": ("check-p1", ["--provider", "PROVIDER_MOD:P", "--json", "PROVIDER_SRC"],
                                            "--json PROVIDER_SRC: is --provider's source PROVIDER_SRC"),
})
ROWS.update(_rows(INV, {
    "inv: device meta": (["--device", "meta"], "--device: expected cpu or cuda[:N], got 'meta'"),
    "inv: device cpu:3": (["--device", "cpu:3"], "--device: expected cpu or cuda[:N], got 'cpu:3'"),
    "inv: absurd layers": (["--layers", str(10**9)], "--layers"),
    "inv: json onto its own plot": (["--json", "DIR/x.png"],
                                    "the failure plot DIR/x.png: the same path as --json DIR/x.png"),
    "inv: json onto the out report": (["--out", "DIR", "--json", "DIR/invariance_torch_bf16_tiny.json"],
                                      "--out DIR/invariance_torch_bf16_tiny.json: the same path as --json"),
    "inv: json onto the manifest": (["--manifest", "MANIFEST", "--json", "MANIFEST"],
                                    "--json MANIFEST: is --manifest MANIFEST, an input of this run"),
    "inv: json onto the checkpoint's config": (["--weights-path", "CKPT", "--json", "CKPT/config.json"],
                                               "--json CKPT/config.json: is a file of --weights-path CKPT"),
    "inv: json onto the checkpoint's weights": (["--weights-path", "CKPT", "--json", "CKPT/model.safetensors"],
                                                "--json CKPT/model.safetensors: is a file of --weights-path CKPT"),
    "inv: json onto --config": (["--config", "CKPT/config.json", "--json", "CKPT/config.json"],
                                "--json CKPT/config.json: is --config CKPT/config.json"),
    "inv: json is a FIFO": (["--json", "PIPE_FILE"], "--json PIPE_FILE: exists and is a FIFO"),
    "inv: json is /dev/null": (["--json", "DEVNULL"], "exists and is a character device"),
    "inv: json links to a directory": (["--json", "DIR_LINK"], "is a directory"),
    "inv: out is a FIFO": (["--out", "PIPE_FILE"], "--out PIPE_FILE: exists and is not a directory"),
    "inv: out links to /dev/null": (["--out", "NULL_LINK"], "--out NULL_LINK: exists and is not a directory"),
}))
ROWS.update({
    "tp: seed 2**80": ("check-tp", ["--seed", str(2**80)], f"--seed: expected an integer in [0, 2**63), got {2**80}"),
    "tp: negative seed": ("check-tp", ["--seed", "-1"], "--seed: expected an integer in [0, 2**63), got -1"),
    "tp: preset gpu on the cpu": ("check-tp", ["--preset", "gpu"], "--preset gpu: sizes for GPU tiles"),
    "tp: preset large on the cpu": ("check-tp", ["--preset", "large"], "--preset large"),
    "tp: json is a FIFO": ("check-tp", ["--json", "PIPE_FILE"], "--json PIPE_FILE: exists and is a FIFO"),
    "tp: json is /dev/null": ("check-tp", ["--json", "DEVNULL"], "exists and is a character device"),
    "tp: json is a directory": ("check-tp", ["--json", "DIR"], "--json DIR: is a directory"),
    "tp: empty world sizes": ("check-tp", ["--world-sizes", ","], "--world-sizes"),
    "golden: device cpu:3": ("mhc-golden", ["--cases", "one_row", "--device", "cpu:3"],
                             "--device: expected cpu or cuda[:N], got 'cpu:3'"),
    "golden: device meta": ("mhc-golden", ["--cases", "one_row", "--device", "meta"], "--device"),
    "golden: write onto a FIFO": ("mhc-golden", ["--write", "--cases", "one_row", "--manifest", "PIPE_FILE"],
                                  "--manifest PIPE_FILE: exists and is a FIFO"),
    "golden: write onto /dev/null": ("mhc-golden", ["--write", "--cases", "one_row", "--manifest", "DEVNULL"],
                                     "exists and is a character device"),
    "golden: write onto a directory": ("mhc-golden", ["--write", "--cases", "one_row", "--manifest", "DIR"],
                                       "is a directory"),
})


QWEN3_TINY = {"model_type": "qwen3", "vocab_size": 257, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False, "hidden_act": "silu"}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Placeholder -> path of a bad input file."""
    from rl_engine.checks.operators.tolerance import DEFAULT_CONTRACT_PATH as CONTRACT_PATH
    from rl_engine.mhc.fixtures import GOLDEN_PATH
    from rl_engine.workload.manifest import MANIFEST_PATH

    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "null_link").symlink_to(os.devnull)
    (tmp_path / "dir_link").symlink_to(tmp_path / "dir", target_is_directory=True)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(QWEN3_TINY))
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"weights")
    shutil.copy(CONTRACT_PATH, tmp_path / "contract.json")
    shutil.copy(GOLDEN_PATH, tmp_path / "golden.json")
    shutil.copy(MANIFEST_PATH, tmp_path / "manifest.json")
    (tmp_path / "planted_provider_mod.py").write_text("from rl_engine.mhc.provider import ReferenceProvider as P\n")
    (tmp_path / "planted_candidate_mod.py").write_text("def logp(logits, target_ids):\n    return logits\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "file").write_text("a file, not a directory\n")
    (tmp_path / "dir").mkdir()
    golden = {"schema": "mhc-golden-v1", "cases": {"one_row": {"contract_fingerprint": "x", "boundaries": [1]}}}
    (tmp_path / "golden_corrupt.json").write_text(json.dumps(golden))
    (tmp_path / "golden_cases_list.json").write_text(json.dumps({"schema": "mhc-golden-v1", "cases": [1]}))
    for name, config_text in [("ckpt_badjson", "{"), ("ckpt_list", "[]")]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config_text)
    return {
        "BADJSON": tmp_path / "bad.json", "LIST": tmp_path / "list.json", "FILE": tmp_path / "file",
        "DIR": tmp_path / "dir", "GOLDEN_CORRUPT": tmp_path / "golden_corrupt.json",
        "GOLDEN_CASES_LIST": tmp_path / "golden_cases_list.json", "CKPT_BADJSON": tmp_path / "ckpt_badjson",
        "CKPT_LIST": tmp_path / "ckpt_list", "PIPE_FILE": tmp_path / "fifo", "DEVNULL": Path(os.devnull),
        "NULL_LINK": tmp_path / "null_link", "DIR_LINK": tmp_path / "dir_link", "CKPT": tmp_path / "ckpt",
        "CONTRACT": tmp_path / "contract.json", "GOLDEN": tmp_path / "golden.json",
        "MANIFEST": tmp_path / "manifest.json", "PROVIDER_MOD": "planted_provider_mod",
        "PROVIDER_SRC": tmp_path / "planted_provider_mod.py", "CANDIDATE_MOD": "planted_candidate_mod",
        "CANDIDATE_SRC": tmp_path / "planted_candidate_mod.py",
    }


def snapshot(root: Path) -> dict:
    """Every entry under `root`, not followed: its kind, size, modification time and (files) content hash."""
    state = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() and not path.is_symlink() else ""
            # a directory's own times change with the writability probe (a file made and removed): not compared
            times = () if path.is_dir() and not path.is_symlink() else (st.st_size, st.st_mtime_ns)
            state[str(path.relative_to(root))] = (st.st_mode, *times, digest)
    return state


def _substitute(text: str, files: dict) -> str:
    for key in sorted(files, key=len, reverse=True):  # CKPT_BADJSON before BADJSON
        text = text.replace(key, str(files[key]))
    return text


def run_cli(capsys, argv):
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


PARAMS = [pytest.param(command, args, expected, id=name, marks=marks)
          for name, (command, args, expected, *marks) in ROWS.items()]


@pytest.mark.parametrize("command, args, expected", PARAMS)
def test_bad_input_is_one_line_and_exit_2_before_any_work(capsys, files, tmp_path, command, args, expected):
    argv = ([command] if command else []) + [_substitute(a, files) for a in args]
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, argv)
    assert snapshot(tmp_path) == before  # nothing written, nothing replaced
    expected = _substitute(expected, files)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rl-engine{' ' + command if command else ''}: error: "), err
    assert expected in lines[0], err
    assert not out  # nothing ran: no progress line, no report


def test_the_fuzz_table_covers_every_subcommand():
    assert {command for command, *_ in ROWS.values()} >= set(cli.SUBCOMMANDS)


# --- the public API: (call, the exception type, what its one line must contain) -------------------------------

def _policy(**kw):
    import torch

    from rl_engine.losses import linear_policy_loss

    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden=torch.randn(1, 3, 8, generator=g), lm_head_weight=torch.randn(11, 8, generator=g),
                  target_ids=torch.tensor([[1, 2, 3]]), advantages=torch.randn(1, 3, generator=g),
                  old_logprobs=-torch.rand(1, 3, generator=g))
    return linear_policy_loss(**{**inputs, **kw})


def _metrics(**kw):
    import torch

    from rl_engine.metrics import rollout_corr_metrics

    inputs = dict(train_logprobs=-torch.rand(2, 3), rollout_logprobs=-torch.rand(2, 3), mask=torch.ones(2, 3))
    return rollout_corr_metrics(**{**inputs, **kw})


def _is_weights(**kw):
    import torch

    from rl_engine.metrics import truncated_is_weights

    return truncated_is_weights(-torch.rand(2, 3), -torch.rand(2, 3), torch.ones(2, 3), **kw)


def _call(path, *args, **kwargs):
    from rl_engine.loading import load_object

    return load_object(path, "api")(*args, **kwargs)


def _meta_triton(op):
    import torch

    from rl_engine.kernels.ops.triton.runtime import check_devices

    return check_devices(op, x=torch.ones(2, device="meta"))


def _patch_a_linear():
    import torch

    from rl_engine.integrations.transformers import patch

    return patch(torch.nn.Linear(2, 2))


def _dims(**kw):
    from rl_engine.checks.operators.operator_inputs import OperatorDims

    return OperatorDims(**kw).validate()


def _suite(**kw):
    from rl_engine.checks.operators.op_checks import run_operator_suite

    return run_operator_suite("logp", candidates=[], cases=[], **kw)


API = {
    "policy loss: kl_coef nan": (lambda p: _policy(kl_coef=float("nan")), ValueError, "kl_coef"),
    "policy loss: kl_coef inf": (lambda p: _policy(kl_coef=float("inf")), ValueError, "kl_coef"),
    "policy loss: entropy_coef negative": (lambda p: _policy(entropy_coef=-1.0), ValueError, "entropy_coef"),
    "policy loss: temperature zero": (lambda p: _policy(temperature=0.0), ValueError, "temperature"),
    "policy loss: temperature inf": (lambda p: _policy(temperature=float("inf")), ValueError, "temperature"),
    "policy loss: normalizer zero": (lambda p: _policy(normalizer=0), ValueError, "normalizer"),
    "policy loss: normalizer negative": (lambda p: _policy(normalizer=-3.0), ValueError, "normalizer"),
    "policy loss: normalizer nan": (lambda p: _policy(normalizer=float("nan")), ValueError, "normalizer"),
    "policy loss: unknown backend": (lambda p: _policy(backend="cuda"), ValueError, "backend"),
    "policy loss: unknown policy": (lambda p: _policy(policy_loss="trpo"), ValueError, "policy_loss"),
    "policy loss: unknown aggregation": (lambda p: _policy(loss_agg_mode="sum"), ValueError, "loss_agg_mode"),
    "policy loss: clip_ratio_low 1.5": (lambda p: _policy(clip_ratio_low=1.5), ValueError, "clip ratios"),
    "policy loss: dual clip 1": (lambda p: _policy(clip_ratio_c=1.0), ValueError, "clip_ratio_c"),
    "policy loss: kl without a reference": (lambda p: _policy(kl_coef=0.1), ValueError, "ref_logprobs"),
    "policy loss: id past the vocabulary": (lambda p: _policy(target_ids=__import__("torch").tensor([[1, 2, 11]])),
                                            ValueError, "target_ids"),
    "policy loss: negative id (pytorch)": (lambda p: _policy(target_ids=__import__("torch").tensor([[1, -1, 3]]),
                                                             backend="pytorch"), (ValueError, IndexError,
                                                                                  RuntimeError), "index"),
    "policy loss: float ids": (lambda p: _policy(target_ids=__import__("torch").zeros(1, 3)), ValueError,
                               "target_ids"),
    "policy loss: meta hidden": (lambda p: _policy(hidden=__import__("torch").ones(1, 3, 8, device="meta")),
                                 ValueError, "hidden is on meta"),
    "metrics: shapes differ": (lambda p: _metrics(mask=__import__("torch").ones(2, 4)), ValueError, "mask"),
    "metrics: unknown is_level": (lambda p: _metrics(is_level="batch"), ValueError, "is_level"),
    "metrics: empty clip range": (lambda p: _metrics(clip_low=1.2, clip_high=0.8), ValueError, "clip range"),
    "metrics: IS threshold below 1": (lambda p: _is_weights(is_threshold=0.5), ValueError, "is_threshold"),
    "outputs: a FIFO": (lambda p: _call("rl_engine.outputs:check_writable", p["PIPE_FILE"], "--out"),
                        UsageError, "exists and is a FIFO"),
    "outputs: /dev/null": (lambda p: _call("rl_engine.outputs:check_writable", os.devnull, "--out"),
                           UsageError, "character device"),
    "outputs: one path twice": (lambda p: _call("rl_engine.outputs:check_run_paths",
                                                [("--a", p["DIR"] / "r.json"), ("--b", p["DIR"] / "r.json")]),
                                UsageError, "the same path as --a"),
    "outputs: onto an input": (lambda p: _call("rl_engine.outputs:check_run_paths", [("--a", p["CONTRACT"])],
                                               [("--contract", p["CONTRACT"])]), UsageError, "an input of this run"),
    "loader: missing config": (lambda p: _call("rl_engine.models.weights:load_hf_config", p["DIR"]),
                               ValueError, "has no config.json"),
    "loader: config is a list": (lambda p: _call("rl_engine.models.weights:load_hf_config", p["LIST"]),
                                 ValueError, "expected a JSON object"),
    "loader: no object path": (lambda p: _call("rl_engine.loading:load_object", "nocolon", "thing"),
                               UsageError, "module:attr"),
    "mhc: zero hidden": (lambda p: _call("rl_engine.mhc.contract:LayerContract", hidden=0), ValueError, "hidden"),
    "mhc: no profile": (lambda p: _call("rl_engine.mhc.contract:judgment_for", None), ValueError,
                        "no numeric_profile"),
    "mhc: provider spec without a class": (lambda p: _call("rl_engine.mhc.provider:check_spec", "a.b"), UsageError,
                                           "module:Class"),
    "mhc: unknown case": (lambda p: _call("rl_engine.mhc.fixtures:select_cases", ["huge"]), UsageError,
                          "unknown case(s) huge"),
    "mhc: missing golden": (lambda p: _call("rl_engine.mhc.fixtures:load_golden", p["DIR"] / "none.json"),
                            UsageError, "not found"),
    "check-op: unknown op": (lambda p: _call("rl_engine.checks.operators.operator_specs:get_spec", "conv"), UsageError,
                          "unknown op 'conv'"),
    "check-op: unknown candidate": (lambda p: _call("rl_engine.checks.operators.operator_specs:make_candidate", "logp",
                                                 "cuda"), UsageError, "unknown candidate"),
    "check-op: theta inf": (lambda p: _dims(theta=float("inf")), ValueError, "theta"),
    "check-op: unknown grad mode": (lambda p: _suite(grad_mode="zeros"), ValueError, "grad_mode"),
    "triton: meta tensor": (lambda p: _meta_triton("rms_norm"), ValueError, "rms_norm: x is on meta"),
    "integrations: not a causal LM": (lambda p: _patch_a_linear(), UsageError, "Linear is not supported"),
    "parallel: unknown backend": (lambda p: _call("rl_engine.parallel.launch:spawn_group", print, 1, backend="mpi"),
                                  ValueError, "backend"),
}


@pytest.mark.parametrize("name", list(API))
def test_bad_api_input_is_one_exception_of_one_line(files, tmp_path, name):
    call, kind, expected = API[name]
    before = snapshot(tmp_path)
    with pytest.raises(kind) as exc:
        call(files)
    message = str(exc.value)
    assert "\n" not in message.strip() and expected in message, message
    assert snapshot(tmp_path) == before
