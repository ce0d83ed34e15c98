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


class RefusesToConstruct:
    def __init__(self):
        raise ValueError("no device handle")


class NotCallableWhenBuilt:
    pass


NOT_CALLABLE = 42
