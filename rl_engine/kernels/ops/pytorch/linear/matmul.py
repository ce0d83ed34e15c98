"""Batched-row matrix product: out[b, s, :] = a[b, s, :] @ b, plus an optional residual [B,S,N] added to the
rounded product (a decoder layer's `h + o_proj(a)`: a kernel may fuse the add, never change its bits)."""

from __future__ import annotations

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_rank, expect_shape


class NativeMatmulOp(NativeOp):
    input_names = ("a", "b", "residual")

    def validate(self, *, a, b, residual=None):
        expect_rank("a", a, 3, "[B,S,K]")
        expect_rank("b", b, 2, "[K,N]")
        if b.shape[0] != a.shape[-1]:
            raise ValueError(f"b: expected shape [K,N] with K={a.shape[-1]} (from a), got {tuple(b.shape)}")
        if residual is not None:
            expect_shape("residual", residual, (*a.shape[:-1], b.shape[1]), "[B,S,N]")
            if residual.dtype != a.dtype:
                raise ValueError(f"residual: expected a's dtype {a.dtype}, got {residual.dtype}")

    def forward(self, *, a, b, residual=None):
        y = a @ b
        return y if residual is None else residual + y
