"""The public entry point `rl_engine.nn` (FusedLinearPolicyLoss, the layers); the code lives in integrations/nn.py."""

from rl_engine.integrations.nn import *  # noqa: F403
