"""The operator harness (`rl-engine check-op`): one candidate of one op against its gold; see docs/harness.md."""
