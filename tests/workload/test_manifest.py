import json

import pytest

from rl_engine.models.families import CONFIGS
from rl_engine.models.weights import content_hash, synthetic_weights
from rl_engine.workload.manifest import MANIFEST_PATH, ManifestError, load_workload


def test_committed_manifest_loads_for_both_models():
    tiny = load_workload(CONFIGS["tiny"])
    assert [s.length for s in tiny.samples] == [11, 16, 13, 19]
    assert all(s.prompt_len == 8 for s in tiny.samples)
    assert tiny.permutation == [2, 0, 3, 1] and tiny.chunk_size == 7
    assert tiny.canonical.name == "bn_packed" and len(tiny.cells) == 7
    big = load_workload(CONFIGS["qwen3-8b"])
    assert max(max(s.token_ids) for s in big.samples) > 257  # drawn from the 8B vocabulary


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])  # tiny-moe: its experts held as [E, ...] stacks
def test_pinned_tiny_weight_hash(name):
    tiny = load_workload(CONFIGS[name])
    assert content_hash(synthetic_weights(CONFIGS[name], tiny.weight_seed)) == tiny.weight_hash


def _edited(tmp_path, edit):
    raw = json.loads(MANIFEST_PATH.read_text())
    edit(raw)
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(raw))
    return path


def test_fixture_hash_is_checked_on_load(tmp_path):
    path = _edited(tmp_path, lambda raw: raw["fixtures"].__setitem__("seed", 2027))
    with pytest.raises(ManifestError, match="fixture_hash"):
        load_workload(CONFIGS["tiny"], path)


def test_config_fingerprint_is_checked(tmp_path):
    path = _edited(tmp_path, lambda raw: raw["models"]["tiny"].__setitem__("config_fingerprint", "0" * 64))
    with pytest.raises(ManifestError, match="config_fingerprint"):
        load_workload(CONFIGS["tiny"], path)


def test_canonical_cell_must_be_packed(tmp_path):
    path = _edited(tmp_path, lambda raw: raw["matrix"].reverse())
    with pytest.raises(ManifestError, match="canonical"):
        load_workload(CONFIGS["tiny"], path)


def test_unreadable_manifest(tmp_path):
    with pytest.raises(ManifestError, match="cannot read"):
        load_workload(CONFIGS["tiny"], tmp_path / "absent.json")


BROKEN = {
    "a list": ("[1, 2]", "expected a JSON object, got a list"),
    "invalid JSON": ('{"schema": ', "cannot read (Expecting value"),
    "not UTF-8": (b"\xff\xfe{}", "cannot read ("),
    "models a list": ("EDIT models []", "manifest.models: expected a JSON object, got list"),
    "fixtures without a seed": ("EDIT fixtures.seed", "fixtures: cannot generate samples (KeyError"),
    "a matrix cell with an unknown key": ("EDIT matrix.0.mode", "matrix: cell {'name': 'bn_packed'"),
    "matrix an object": ("EDIT matrix {}", "manifest.matrix: expected a JSON list, got dict"),
}


def _broken(tmp_path, content):
    if isinstance(content, bytes) or not content.startswith("EDIT"):
        path = tmp_path / "manifest.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path
    edits = {
        "EDIT models []": lambda raw: raw.__setitem__("models", []),
        "EDIT fixtures.seed": lambda raw: raw["fixtures"].pop("seed"),
        "EDIT matrix.0.mode": lambda raw: raw["matrix"][0].__setitem__("mode", "x"),
        "EDIT matrix {}": lambda raw: raw.__setitem__("matrix", {}),
    }
    return _edited(tmp_path, edits[content])


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_manifest_is_one_line_naming_the_file(tmp_path, name):
    content, expected = BROKEN[name]
    path = _broken(tmp_path, content)
    with pytest.raises(ManifestError) as info:
        load_workload(CONFIGS["tiny"], path)
    message = str(info.value)
    assert message.startswith(f"manifest {path}: ") and expected in message and "\n" not in message


def test_every_manifest_error_names_the_file(tmp_path):
    path = _edited(tmp_path, lambda raw: raw["fixtures"].__setitem__("seed", 2027))
    with pytest.raises(ManifestError, match=f"^manifest {path}: models.tiny.fixture_hash"):
        load_workload(CONFIGS["tiny"], path)


def test_a_list_manifest_exits_2_from_the_cli(tmp_path, capsys):
    from rl_engine import cli

    path = tmp_path / "manifest.json"
    path.write_text("[]")
    code = cli.main(["check-invariance", "--profile", "reference_fp32", "--manifest", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and not out and len(err.splitlines()) == 1
    assert f"manifest {path}: expected a JSON object, got a list" in err and "Traceback" not in err
