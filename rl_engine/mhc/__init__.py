"""Strict-fp32 mHC + RMSNorm: numerics, contract, oracle, providers, fixtures, trace and acceptance
(see docs/mhc.md)."""
