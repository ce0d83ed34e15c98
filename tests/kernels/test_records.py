"""The op records are the one declaration everything else is derived from: these tests fail when a copy
appears somewhere (the contract, the profiles, the registry, the docs table) and drifts."""

import re
from pathlib import Path

import pytest

from rl_engine.checks.operators.operator_inputs import INPUT_BUILDERS
from rl_engine.checks.operators.tolerance import load_contract
from rl_engine.kernels.records import MODEL_OPS, OP_CLASSES, OPS
from rl_engine.kernels.registry import BACKENDS, REGISTRY
from rl_engine.loading import load_object
from rl_engine.models.profiles import PROFILES

ROOT = Path(__file__).resolve().parents[2]


def test_the_contract_judges_exactly_the_record_classes():
    assert set(load_contract()["op_classes"]) == set(OP_CLASSES)


@pytest.mark.parametrize("op", list(OPS))
def test_every_record_names_loadable_classes_whose_inputs_it_declares(op):
    record = OPS[op]
    gold = load_object(record.gold_path, "gold op")
    triton_cls = load_object(record.triton_path, "kernel")
    declared = set(record.grad_input_names) | set(record.batch_input_names)
    assert declared <= set(gold.input_names), declared - set(gold.input_names)
    assert set(triton_cls.input_names) == set(gold.input_names)
    assert op in INPUT_BUILDERS


def test_the_registry_has_every_backend_of_every_record_and_nothing_else():
    assert {(i.op, i.backend) for i in REGISTRY.implementations()} == {(op, b) for op in OPS for b in BACKENDS}
    for record in OPS.values():
        assert REGISTRY.lookup(record.name, "reference").target == record.gold_path
        assert REGISTRY.lookup(record.name, "torch").target == record.gold_path + ".baseline"
        assert REGISTRY.lookup(record.name, "triton").target == record.triton_path


def test_profiles_declare_the_model_ops_and_fp32_logprobs():
    for profile in PROFILES.values():
        assert tuple(profile.declared) == MODEL_OPS
        for op, declared in profile.declared.items():
            if OPS[op].fp32_output:
                assert declared.output_dtype == "fp32"


def test_the_docs_table_covers_every_op():
    rows = re.findall(r"^\| ([a-z_, ]+) \|", (ROOT / "docs" / "kernels.md").read_text(), re.MULTILINE)
    documented = {name.strip() for row in rows for name in row.split(",")} - {"op"}
    assert documented == set(OPS), documented ^ set(OPS)
