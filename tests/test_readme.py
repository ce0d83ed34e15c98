"""The README's example output is what its commands print: each `$ command` line of a fenced block runs verbatim
in a shell, from the repository root, with the environment a user's shell would have (this process's, less what
the test setup adds: TRITON_INTERPRET; the venv's bin/ first on PATH so `rl-engine` resolves), and the lines
below it must match the command's stdout (its stderr when stdout is empty, as for a usage error).

Matching is line by line after normalising only what changes from machine to machine or run to run: dates,
package versions, the machine's name, timings. A line `...` stands for any number of lines. So the README
never drifts from the code: change either and this fails, naming the first line that differs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 300  # the slowest example takes ~20 s alone; CI runs two suites side by side on 2 cores

VOLATILE = [
    (re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?([+-]\d{2}:\d{2})?"), "<date>"),
    (re.compile(r"\b(python|torch|triton|numpy|cuda|transformers)=\S+"), r"\1=<version>"),
    (re.compile(r"\bdevice_name=\S+"), "device_name=<machine>"),
    (re.compile(r"\bdevice (\w+) \([^)]*\)"), r"device \1 (<machine>)"),
    (re.compile(r"^rl-engine \d+\.\d+\S*$"), "rl-engine <version>"),
    (re.compile(r"\b\d+(\.\d+)?s\b"), "<time>s"),
    (re.compile(r"canonical forward s:.*"), "canonical forward s: <times>"),
]


def normalise(line: str) -> str:
    line = line.rstrip()
    for pattern, replacement in VOLATILE:
        line = pattern.sub(replacement, line)
    return line


def examples(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number, command, expected output lines) of each `$ ` line inside a fenced code block."""
    found, in_block, current = [], False, None
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_block, current = not in_block, None
        elif in_block and line.startswith("$ "):
            current = (number, line[2:], [])
            found.append(current)
        elif in_block and current is not None:
            current[2].append(line)
    return found


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether `actual` is `expected` line for line, where an expected `...` line matches any run of lines."""
    @cache
    def match(i: int, j: int) -> bool:
        if i == len(expected):
            return j == len(actual)
        if expected[i] == "...":
            return match(i + 1, j) or (j < len(actual) and match(i, j + 1))
        return j < len(actual) and expected[i] == actual[j] and match(i + 1, j + 1)

    return match(0, 0)


def user_environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


EXAMPLES = examples(README.read_text())


def test_the_readme_has_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("line, command, expected", EXAMPLES, ids=[f"README.md:{e[0]}" for e in EXAMPLES])
def test_readme_example(line, command, expected):
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=user_environment(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    actual = (done.stdout if done.stdout.strip() else done.stderr).splitlines()
    want, got = [normalise(x) for x in expected], [normalise(x) for x in actual]
    assert matches(want, got), (f"README.md:{line}: `{command}` printed (exit {done.returncode}):\n"
                                + "\n".join(actual) + f"\n--- stderr:\n{done.stderr[-2000:]}")


# The matcher itself, on planted differences.
def test_matcher_catches_a_changed_number_and_allows_volatile_fields():
    assert matches(["a", "...", "z"], ["a", "b", "c", "z"]) and matches(["a", "..."], ["a"])
    assert not matches(["a", "b"], ["a", "b", "c"]) and not matches(["x", "..."], ["a"])
    readme = "contract=sha256:ab seed=0 date=2026-11-30T16:26:06+00:00 python=3.11.7 torch=2.13.0+cpu device_name=x86"
    run = "contract=sha256:ab seed=0 date=2026-12-05T08:00:00+00:00 python=3.12.1 torch=2.11.0 device_name=arm"
    assert normalise(readme) == normalise(run)
    assert normalise("packed_t16 PASS 0.09s") == normalise("packed_t16 PASS 1.50s")
    assert normalise("max|Δ| 0.00111") != normalise("max|Δ| 0.00112")
    assert normalise("contract=sha256:ab") != normalise("contract=sha256:ac")


def test_examples_are_read_from_fenced_blocks_only():
    text = "$ not run\n```\n$ echo hi   # comment\nhi\n...\n```\n```bash\npip install x\n```\n"
    assert examples(text) == [(3, "echo hi   # comment", ["hi", "..."])]
