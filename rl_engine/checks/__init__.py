"""The checkers: code that judges other code, one room for each kind of claim.

- `operators/`: one op's candidate against its gold, forward, backward and batch invariance (`rl-engine check-op`);
- `forward_invariance/`: a whole decoder's selected logprobs across configurations, and train/infer parity
  (`rl-engine check-invariance`);
- `tp_invariance/`: the tensor-parallel ops and decoder on TP = 1, 2, 4, bit for bit (`rl-engine check-tp`);
- `mhc_acceptance.py`: an mHC provider against the strict-fp32 oracle and the golden hashes (`rl-engine check-p1`);
- `testing.py`: the operator check inside a user's own test suite (`assert_operator_matches`).

Checkers may import anything in the package; nothing below them (kernels, models, parallel, rollout) imports a
checker (tests/test_import_graph.py).
"""
