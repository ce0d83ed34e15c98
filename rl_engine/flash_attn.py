"""The public entry point `rl_engine.flash_attn`; the code lives in rl_engine/integrations/flash_attn.py."""

from rl_engine.integrations.flash_attn import *  # noqa: F403
