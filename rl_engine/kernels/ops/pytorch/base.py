"""What every gold operator shares: fp32 execution with TF32 off, the baseline, input checks.

A gold op's `forward(**inputs)` is written once, dtype-agnostic. Calling the op (`op(**inputs)`)
runs it as the *reference*: bf16/fp16 inputs upcast to fp32, TF32 off, fp32 outputs (float64
inputs stay float64, for gradcheck). `baseline`
runs the same formula in the inputs' own dtype: what a user gets from plain PyTorch today.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def tf32_off():
    """Disable TF32 for fp32 matmuls and convolutions for the duration; restore the caller's after.

    torch >= 2.9 has per-backend `fp32_precision`; reading the legacy `allow_tf32` flags after
    anyone used the new API raises, so the new API is used wherever it exists.
    """
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):
        conv = torch.backends.cudnn.conv
        saved = (matmul.fp32_precision, conv.fp32_precision)
        matmul.fp32_precision, conv.fp32_precision = "ieee", "ieee"
        try:
            yield
        finally:
            matmul.fp32_precision, conv.fp32_precision = saved
        return
    saved = (matmul.allow_tf32, conv.allow_tf32)
    matmul.allow_tf32 = conv.allow_tf32 = False
    try:
        yield
    finally:
        matmul.allow_tf32, conv.allow_tf32 = saved


def expect_shape(name: str, tensor: torch.Tensor, expected: tuple, meaning: str) -> None:
    """Raise ValueError naming the input when `tensor` does not have shape `expected`."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a tensor of shape {meaning}, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {meaning} = {tuple(expected)}, got {tuple(tensor.shape)}")


def expect_rank(name: str, tensor: torch.Tensor, rank: int, meaning: str) -> None:
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != rank:
        got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name}: expected shape {meaning} (rank {rank}), got {got}")


def expect_float(name: str, tensor: torch.Tensor, meaning: str) -> None:
    """Raise ValueError naming the input when `tensor` is not floating point (integer math would silently
    truncate, e.g. rope's cos and sin)."""
    if not tensor.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor {meaning}, got dtype {tensor.dtype}")


def capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on t's device: values cannot be read back to the host, so
    value checks are skipped there (a graph's inputs are checked where they are built, e.g. the rollout
    engine's admission; the eager warm-up before each capture runs every check)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def expect_ids_in_range(name: str, ids: torch.Tensor, upper: int, meaning: str) -> None:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name}: expected integer ids {meaning}, got dtype {ids.dtype}")
    if ids.numel() and not capturing(ids) and (int(ids.min()) < 0 or int(ids.max()) >= upper):
        raise ValueError(
            f"{name}: ids must lie in [0, {upper}) for {meaning}; got min {int(ids.min())}, max {int(ids.max())}"
        )


class NativeOp:
    """Base of the gold ops. Subclasses define `input_names`, `validate` and `forward`."""

    input_names: tuple[str, ...] = ()

    def validate(self, **inputs) -> None:  # pragma: no cover - every op overrides
        pass

    def forward(self, **inputs):  # pragma: no cover - every op overrides
        raise NotImplementedError

    def _check_names(self, inputs: dict) -> None:
        unknown = set(inputs) - set(self.input_names)
        if unknown:
            raise ValueError(f"{type(self).__name__}: unknown inputs {sorted(unknown)}; expected {self.input_names}")

    def __call__(self, **inputs):
        self._check_names(inputs)
        self.validate(**inputs)
        # Narrow floats go up to fp32; float64 stays, so gradcheck can run the same formula.
        upcast = {
            k: (v.float() if isinstance(v, torch.Tensor) and v.dtype in (torch.bfloat16, torch.float16) else v)
            for k, v in inputs.items()
        }
        with tf32_off():
            return self.forward(**upcast)

    def baseline(self, **inputs):
        """The same formula in the inputs' own dtype (no upcast): what plain PyTorch gives today."""
        self._check_names(inputs)
        self.validate(**inputs)
        return self.forward(**inputs)
