"""Triton candidates for the loss family: selected-token logprob, and the fused linear + logprob."""
