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
    """Disable TF32 (cuBLAS and cuDNN) for the duration; restore the caller's settings after."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul
        torch.backends.cudnn.allow_tf32 = cudnn
        torch.set_float32_matmul_precision(precision)


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


def expect_ids_in_range(name: str, ids: torch.Tensor, upper: int, meaning: str) -> None:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name}: expected integer ids {meaning}, got dtype {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= upper):
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
