"""Glue that puts rl_engine's ops inside other libraries' models."""
