"""Batched-row matrix product: out[b, s, :] = a[b, s, :] @ b."""

from __future__ import annotations

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_rank


class NativeMatmulOp(NativeOp):
    input_names = ("a", "b")

    def validate(self, *, a, b):
        expect_rank("a", a, 3, "[B,S,K]")
        expect_rank("b", b, 2, "[K,N]")
        if b.shape[0] != a.shape[-1]:
            raise ValueError(f"b: expected shape [K,N] with K={a.shape[-1]} (from a), got {tuple(b.shape)}")

    def forward(self, *, a, b):
        return a @ b
