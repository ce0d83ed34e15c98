"""Fused linear + selected-token log-probability: logp of target under hidden @ W^T (+ bias)."""

from __future__ import annotations

from rl_engine.kernels.ops.pytorch.base import NativeOp, expect_ids_in_range, expect_rank, expect_shape
from rl_engine.kernels.ops.pytorch.loss.logp import selected_logprobs


class NativeLinearLogpOp(NativeOp):
    input_names = ("hidden", "lm_head_weight", "target_ids", "bias")

    def validate(self, *, hidden, lm_head_weight, target_ids, bias=None):
        expect_rank("hidden", hidden, 3, "[B,S,H]")
        b, s, h = hidden.shape
        expect_rank("lm_head_weight", lm_head_weight, 2, "[V,H]")
        v = lm_head_weight.shape[0]
        expect_shape("lm_head_weight", lm_head_weight, (v, h), "[V,H]")
        expect_shape("target_ids", target_ids, (b, s), "[B,S]")
        expect_ids_in_range("target_ids", target_ids, v, f"vocabulary size V={v}")
        if bias is not None:
            expect_shape("bias", bias, (v,), "[V]")

    def forward(self, *, hidden, lm_head_weight, target_ids, bias=None):
        logits = hidden @ lm_head_weight.t()
        if bias is not None:
            logits = logits + bias
        return selected_logprobs(logits, target_ids)

    def baseline(self, *, hidden, lm_head_weight, target_ids, bias=None):
        """What RL trainers do today: logits from a matmul in the inputs' dtype, then an fp32 log-softmax."""
        self.validate(hidden=hidden, lm_head_weight=lm_head_weight, target_ids=target_ids, bias=bias)
        logits = hidden @ lm_head_weight.t()
        if bias is not None:
            logits = logits + bias
        return selected_logprobs(logits.float(), target_ids)
