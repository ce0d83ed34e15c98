"""Strict-fp32 mHC + RMSNorm: numerics, contract, oracle, providers, fixtures and trace (see docs/mhc.md).
The acceptance command that judges a provider is rl_engine/checks/mhc_acceptance.py."""
