"""The tolerance contract: the packaged file is valid, resolution picks overrides, bad contracts name the key."""

import copy
import json

import pytest

from rl_engine.checks.operators.tolerance import (
    DTYPES,
    JUDGMENTS,
    ContractError,
    contract_fingerprint,
    load_contract,
    resolve_tolerance,
    validate_contract,
)


@pytest.fixture(scope="module")
def contract():
    return load_contract()


def test_packaged_contract_covers_every_judgment_class_and_dtype(contract):
    for judgment in JUDGMENTS:
        for op_class in contract["op_classes"]:
            for dtype in DTYPES:
                tol = resolve_tolerance(contract, judgment=judgment, op_class=op_class, dtype=dtype)
                assert tol.rationale
                if "invariance" in judgment:
                    assert tol.mode == "bitwise"


def test_bf16_logprob_matmul_attention_are_baseline_relative(contract):
    for op_class in ("logprob", "matmul", "attention"):
        for dtype in ("bf16", "fp16"):
            assert resolve_tolerance(contract, judgment="forward_accuracy", op_class=op_class, dtype=dtype).mode == (
                "baseline_relative"
            )


def test_arch_override_applies_only_with_its_key(contract):
    default = resolve_tolerance(contract, judgment="forward_accuracy", op_class="matmul", dtype="fp32")
    sm90 = resolve_tolerance(contract, judgment="forward_accuracy", op_class="matmul", dtype="fp32", arch_key="sm90")
    other = resolve_tolerance(contract, judgment="forward_accuracy", op_class="matmul", dtype="fp32", arch_key="sm80")
    assert default.arch_key is None and other == default
    assert sm90.arch_key == "sm90" and sm90.atol != default.atol


def test_fingerprint_is_stable_and_changes_with_content(contract):
    again = json.loads(json.dumps(contract))
    assert contract_fingerprint(again) == contract_fingerprint(contract)
    again["rows"][0]["atol"] = again["rows"][0].get("atol", 0) + 1
    assert contract_fingerprint(again) != contract_fingerprint(contract)


def _first(rows, **match):
    return next(i for i, r in enumerate(rows) if all(r.get(k) == v for k, v in match.items()))


def _break(contract, edit):
    bad = copy.deepcopy(contract)
    edit(bad)
    return bad


FA = dict(judgment="forward_accuracy", op_class="elementwise", dtype="fp32")
INV = dict(judgment="forward_invariance", op_class="elementwise", dtype="fp32")


def _set(row_match, key, value):
    def edit(c):
        c["rows"][_first(c["rows"], **row_match)][key] = value
    return edit


def _drop(row_match, key):
    def edit(c):
        del c["rows"][_first(c["rows"], **row_match)][key]
    return edit


MALFORMED = {
    "missing rows": (lambda c: c.pop("rows"), "rows"),
    "unknown top-level key": (lambda c: c.update(tolerances=[]), "tolerances"),
    "wrong schema version": (lambda c: c.update(schema_version=7), "schema_version"),
    "row missing mode": (_drop(FA, "mode"), ".mode"),
    "unknown mode": (_set(FA, "mode", "fuzzy"), ".mode"),
    "unknown dtype": (_set(FA, "dtype", "fp8"), ".dtype"),
    "unknown op class": (_set(FA, "op_class", "convolution"), ".op_class"),
    "unknown row key": (_set(FA, "ulps", 3), ".ulps"),
    "negative atol": (_set(FA, "atol", -1.0), ".atol"),
    "atol not a number": (_set(FA, "atol", "1e-5"), ".atol"),
    "allclose without rtol": (_drop(FA, "rtol"), ".rtol"),
    "bitwise with atol": (_set(INV, "atol", 0.0), ".atol"),
    "invariance row not bitwise": (lambda c: c["rows"][_first(c["rows"], **INV)].update(
        mode="allclose", atol=0.0, rtol=0.0), ".mode"),
    "empty rationale": (_set(FA, "rationale", " "), ".rationale"),
    "two-line rationale": (_set(FA, "rationale", "a\nb"), ".rationale"),
    "baseline k below one": (_set(dict(judgment="forward_accuracy", op_class="logprob", dtype="bf16"), "k", 0.5),
                             ".k"),
    "duplicate row": (lambda c: c["rows"].append(dict(c["rows"][_first(c["rows"], **FA)])), "duplicates"),
    "missing default row": (lambda c: c["rows"].pop(_first(c["rows"], **FA)), "judgment=forward_accuracy"),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_contract_errors_name_the_key(contract, name):
    edit, key = MALFORMED[name]
    with pytest.raises(ContractError, match=r"\S") as info:
        validate_contract(_break(contract, edit))
    assert key in str(info.value), str(info.value)


def test_load_contract_reports_unreadable_and_invalid_files(tmp_path, contract):
    with pytest.raises(ContractError, match="cannot read"):
        load_contract(tmp_path / "absent.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ContractError, match="not JSON"):
        load_contract(tmp_path / "bad.json")
    (tmp_path / "neg.json").write_text(json.dumps(_break(contract, _set(FA, "rtol", -2))))
    with pytest.raises(ContractError, match=r"rows\[\d+\]\.rtol"):
        load_contract(tmp_path / "neg.json")
