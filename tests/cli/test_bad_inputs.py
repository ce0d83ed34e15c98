"""Every subcommand, driven with bad inputs: exit 2, exactly one line on stderr, no traceback, no work done.

Rows run in-process through cli.main (argparse errors arrive as SystemExit). Placeholders in the
arguments are files made per test: BADJSON (not JSON), LIST (a JSON list), FILE (a regular file,
so FILE/x.json has a parent that is not a directory), DIR (an existing directory), and the rest below.
"""

import json

import pytest

from rl_engine import cli

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


@pytest.fixture
def files(tmp_path):
    """Placeholder -> path of a bad input file."""
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
        "CKPT_LIST": tmp_path / "ckpt_list",
    }


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
def test_bad_input_is_one_line_and_exit_2_before_any_work(capsys, files, command, args, expected):
    argv = ([command] if command else []) + [_substitute(a, files) for a in args]
    code, out, err = run_cli(capsys, argv)
    expected = _substitute(expected, files)
    lines = err.splitlines()
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"rl-engine{' ' + command if command else ''}: error: "), err
    assert expected in lines[0], err
    assert not out  # nothing ran: no progress line, no report


def test_the_fuzz_table_covers_every_subcommand():
    assert {command for command, *_ in ROWS.values()} >= set(cli.SUBCOMMANDS)
