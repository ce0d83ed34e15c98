"""Candidates from outside the package, as a user would write them, for `check-op --candidate module:attr`."""

import torch


def logp(logits, target_ids):
    """Correct: plain torch, in the candidate's dtype, logprobs in fp32."""
    logits = logits.float()
    picked = torch.gather(logits, -1, target_ids.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def logp_scaled(logits, target_ids):
    """Planted bug: off by a scale of 1.01."""
    return 1.01 * logp(logits, target_ids)


class LogpOp:
    """A class, constructed (with the op's constructor dims: none for logp) and then called."""

    def __call__(self, *, logits, target_ids):
        return logp(logits, target_ids)


def logp_raises(logits, target_ids):
    raise RuntimeError("kernel exploded")


def logp_exits(logits, target_ids):
    raise SystemExit(0)


class CandidateGaveUp(BaseException):
    """Not an Exception: a bare `except Exception` would let it through."""


def logp_base_exception(logits, target_ids):
    raise CandidateGaveUp("no kernel for this shape")


def logp_hangs(logits, target_ids):
    import time
    time.sleep(3600)


def logp_swallows_everything(logits, target_ids):
    """Hangs, and swallows whatever is raised to stop it."""
    import time
    while True:
        try:
            time.sleep(3600)
        except BaseException:  # noqa: BLE001 - the planted bug
            pass


def logp_backward_exits(logits, target_ids):
    class Exits(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise SystemExit(0)

    return Exits.apply(logp(logits, target_ids))


class RefusesToConstruct:
    def __init__(self):
        raise ValueError("no device handle")


class NotCallableWhenBuilt:
    pass


NOT_CALLABLE = 42
