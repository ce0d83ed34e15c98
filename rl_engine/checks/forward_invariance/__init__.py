"""Forward invariance (`rl-engine check-invariance`): a decoder's logprobs across configurations, and train/infer
parity; see docs/invariance.md."""
