"""Output paths checked before the work, reports written atomically, and the one-line boundary of cli.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_engine import cli
from rl_engine.errors import UsageError
from rl_engine.outputs import atomic_path, check_writable, write_atomic


def test_missing_parents_are_fine_and_the_check_creates_nothing(tmp_path):
    assert check_writable(tmp_path / "a" / "b" / "r.json", "--json") == tmp_path / "a" / "b" / "r.json"
    check_writable(tmp_path / "new_dir", "--out", directory=True)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("target, directory, message", [
    ("file/x.json", False, "file is not a directory"),
    ("file/deeper/x.json", False, "file is not a directory"),
    ("file", True, "exists and is not a directory"),
    ("dir", False, "is a directory"),
])
def test_unusable_paths_name_the_flag_and_the_path(tmp_path, target, directory, message):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    with pytest.raises(UsageError) as exc:
        check_writable(tmp_path / target, "--flag", directory=directory)
    assert str(exc.value).startswith(f"--flag {tmp_path / target}: ") and message in str(exc.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_directory_is_refused(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(UsageError, match="cannot write in"):
        check_writable(tmp_path / "ro" / "sub" / "x.json", "--json")


def test_write_atomic_writes_with_the_umask_mode_and_leaves_no_temporary(tmp_path):
    path = write_atomic(tmp_path / "sub" / "r.json", "{}\n", "--json")
    assert path.read_text() == "{}\n" and os.listdir(path.parent) == ["r.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_write_leaves_the_old_report_whole(tmp_path, error):
    path = tmp_path / "r.json"
    path.write_text("old report\n")
    with pytest.raises(error):
        with atomic_path(path) as tmp:
            tmp.write_text("half a new rep")
            raise error()
    assert path.read_text() == "old report\n" and os.listdir(tmp_path) == ["r.json"]


def test_the_temporary_keeps_the_suffix_so_writers_pick_the_format(tmp_path):
    with atomic_path(tmp_path / "plot.png") as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png"
        tmp.write_bytes(b"png")
    assert (tmp_path / "plot.png").read_bytes() == b"png"


def _fail(*args, **kwargs):
    raise AssertionError("the work started before the output path was checked")


@pytest.mark.parametrize("argv, target", [
    (["check-op", "--op", "silu", "--device", "cpu", "--json-out", "FILE/r.json"],
     "rl_engine.checks.operators.check_op.run_operator_suite"),
    (["check-invariance", "--profile", "torch_bf16", "--json", "FILE/r.json"],
     "rl_engine.checks.forward_invariance.harness.run_harness"),
    (["check-invariance", "--profile", "torch_bf16", "--out", "FILE"],
     "rl_engine.checks.forward_invariance.harness.run_harness"),
    (["check-p1", "--provider", "rl_engine.mhc.provider:ReferenceProvider", "--json", "FILE/r.json"],
     "rl_engine.checks.mhc_acceptance.check_provider"),
    (["check-tp", "--json", "FILE/r.json"], "rl_engine.checks.tp_invariance.check.spawn_group"),
    (["mhc-golden", "--write", "--manifest", "FILE/g.json"], "rl_engine.mhc.fixtures.oracle_trace"),
])
def test_a_bad_output_path_stops_the_command_before_the_work(tmp_path, monkeypatch, capsys, argv, target):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(target, _fail)
    code = cli.main([a.replace("FILE", str(tmp_path / "file")) for a in argv])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and str(tmp_path / "file") in err, err


CPU_OOM = ("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you tried to "
           "allocate 320000000000 bytes. Error code 12 (Cannot allocate memory)")
CUDA_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.8 GiB of which 1.0 GiB "
            "is free.\nOf the allocated memory ...")


@pytest.mark.parametrize("exc, message", [
    (RuntimeError(CPU_OOM), "out of memory: tried to allocate 320000000000 bytes (298.0 GiB); use smaller sizes"),
    (RuntimeError(CUDA_OOM), "out of memory: tried to allocate 2.00 GiB; use smaller sizes"),
    (MemoryError(), "out of memory; use smaller sizes"),
    (RuntimeError("shape mismatch"), None),
    (ValueError("bad value"), None),
])
def test_out_of_memory_message_names_the_size_asked_for(exc, message):
    assert cli.out_of_memory_message(exc) == message


def test_out_of_memory_at_the_boundary_is_one_line_and_exit_2(monkeypatch, capsys):
    def run(args):
        raise RuntimeError(CPU_OOM)

    monkeypatch.setattr("rl_engine.mhc.fixtures.run", run)
    assert cli.main(["mhc-golden"]) == 2
    assert capsys.readouterr().err == ("rl-engine mhc-golden: error: out of memory: tried to allocate 320000000000 "
                                       "bytes (298.0 GiB); use smaller sizes\n")


def test_a_bug_still_shows_its_traceback(monkeypatch):
    def run(args):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr("rl_engine.mhc.fixtures.run", run)
    with pytest.raises(ZeroDivisionError):
        cli.main(["mhc-golden"])


def test_argparse_errors_are_one_line_for_the_main_parser_and_subparsers(capsys):
    for argv, line in [
        (["check-tp", "--preset"], "rl-engine check-tp: error: argument --preset: expected one argument"),
        (["check-tp", "--bogus"], "rl-engine check-tp: error: unrecognized arguments: --bogus"),
        (["--bogus"], "rl-engine: error: unrecognized arguments: --bogus"),
    ]:
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2 and capsys.readouterr().err == line + "\n"


def test_help_is_still_help(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["check-tp", "--help"])
    assert exc.value.code == 0 and "--world-sizes" in capsys.readouterr().out


def test_a_closed_output_pipe_ends_quietly():
    # `rl-engine check-op --list | head -0`: the reader is gone before the first line is written.
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    child = subprocess.run([sys.executable, "-m", "rl_engine.cli", "check-op", "--list"], stdout=write_end,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(write_end)
    assert child.returncode == 141 and child.stderr == "", child.stderr


def test_an_output_on_an_input_or_on_another_output_is_refused_through_links(tmp_path):
    from rl_engine.outputs import check_run_paths

    (tmp_path / "ckpt").mkdir()
    config = tmp_path / "ckpt" / "config.json"
    config.write_text("{}")
    os.link(config, tmp_path / "hard.json")
    (tmp_path / "soft.json").symlink_to(config)
    dotted = tmp_path / "sub" / ".." / "ckpt" / "config.json"
    for out in (config, tmp_path / "hard.json", tmp_path / "soft.json", dotted):
        with pytest.raises(UsageError, match=r"an input of this run"):
            check_run_paths([("--json", out)], [("--config", config)])
    with pytest.raises(UsageError, match=r"is a file of --weights-path"):
        check_run_paths([("--json", config)], [("--weights-path", tmp_path / "ckpt")])
    check_run_paths([("--json", tmp_path / "ckpt" / "new_report.json")], [("--weights-path", tmp_path / "ckpt")])
    with pytest.raises(UsageError, match=r"--b .*the same path as --a"):
        check_run_paths([("--a", tmp_path / "r.json"), ("--b", tmp_path / "sub" / ".." / "r.json")])
    check_run_paths([("--a", tmp_path / "r.json"), ("--b", None)], [("--c", None)])
    assert config.read_text() == "{}"


def test_an_existing_non_regular_file_is_never_replaced(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "null").symlink_to(os.devnull)
    for path, kind in ((tmp_path / "fifo", "a FIFO"), (tmp_path / "null", "a character device"),
                       (Path(os.devnull), "a character device")):
        with pytest.raises(UsageError, match=f"exists and is {kind}, not a regular file"):
            check_writable(path, "--json")
