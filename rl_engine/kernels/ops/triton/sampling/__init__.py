"""Triton candidates for token sampling: one program per row draws the row's token."""
