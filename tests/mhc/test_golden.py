"""The oracle still reproduces the committed golden hashes, and the manifest changes only on --write."""

import json
import shutil

import pytest
import torch

from rl_engine.cli import main
from rl_engine.mhc import fixtures
from rl_engine.mhc.trace import BOUNDARY_NAMES, boundaries_for, tensor_sha256


@pytest.mark.parametrize("case", fixtures.CASES, ids=lambda c: c.name)
def test_oracle_matches_the_committed_golden_hashes(case):
    golden = fixtures.load_golden()["cases"][case.name]
    assert golden["layer_contract_fingerprint"] == case.contract().fingerprint()
    trace = fixtures.oracle_trace(case)
    assert list(trace) == [b.name for b in boundaries_for(case.contract())]
    assert set(trace) <= set(BOUNDARY_NAMES)
    for name, tensor in trace.items():
        assert golden["boundaries"][name]["sha256"] == tensor_sha256(tensor), name


def test_hash_is_over_raw_little_endian_bytes():
    t = torch.tensor([1.0, -2.0], dtype=torch.float32)
    import hashlib
    assert tensor_sha256(t) == hashlib.sha256(bytes.fromhex("0000803f000000c0")).hexdigest()


def test_mhc_golden_checks_without_writing_and_writes_only_when_asked(tmp_path, capsys):
    manifest = tmp_path / "golden.json"
    shutil.copy(fixtures.GOLDEN_PATH, manifest)
    assert main(["mhc-golden", "--cases", "one_row", "--manifest", str(manifest)]) == 0
    data = json.loads(manifest.read_text())
    data["cases"]["one_row"]["boundaries"]["fwd.pre.u"]["sha256"] = "0" * 64
    manifest.write_text(json.dumps(data))
    before = manifest.read_text()
    assert main(["mhc-golden", "--cases", "one_row", "--manifest", str(manifest)]) == 1
    assert "DIFFERS: fwd.pre.u" in capsys.readouterr().out
    assert manifest.read_text() == before  # a check never rewrites
    assert main(["mhc-golden", "--cases", "one_row", "--write", "--manifest", str(manifest)]) == 0
    assert main(["mhc-golden", "--cases", "one_row", "--manifest", str(manifest)]) == 0
    assert set(json.loads(manifest.read_text())["cases"]) == set(data["cases"])  # other cases kept


def test_mhc_golden_usage_errors(capsys):
    assert main(["mhc-golden", "--cases", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown case" in err
