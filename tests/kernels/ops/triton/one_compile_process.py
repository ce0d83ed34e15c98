"""One subprocess (the interpreter off) compiles every case of a parametrised sm_90a compile test that this session
runs: a case pays no Python, torch and Triton start of its own (most of a case's time when each had its own process).

`script` defines `compile_case(*args) -> dict`; each selected case's args come from `case_args(params)`. A case that
raises is reported as {"error": its traceback}, so one failing case fails its own test only; a process that dies fails
every test that reads it, with its stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_RUNNER = """
import json, sys, traceback
exec(sys.argv[1])
for args in json.loads(sys.argv[2]):
    try:
        result = compile_case(*args)
    except Exception:
        result = {"error": traceback.format_exc()[-2000:]}
    print(json.dumps({"args": args, "result": result}), flush=True)
"""


def compile_selected(request, test_name: str, script: str, case_args) -> dict:
    """{tuple(case_args(params)): result} for every item of `test_name` in the requesting module this session runs."""
    cases = []
    for item in request.session.items:
        if item.path == request.path and getattr(item, "originalname", None) == test_name:
            args = list(case_args(item.callspec.params))
            if args not in cases:
                cases.append(args)
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _RUNNER, script, json.dumps(cases)], capture_output=True, text=True,
                          env=env, timeout=600 + 60 * len(cases))
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith('{"args": '):
            row = json.loads(line)
            results[tuple(row["args"])] = row["result"]
    assert len(results) == len(cases), (cases, proc.stderr[-2000:])
    return results


def case_result(results: dict, args) -> dict:
    """The case's result; fails the test with the case's own traceback if its compile raised."""
    result = results[tuple(args)]
    assert "error" not in result, result["error"]
    return result
