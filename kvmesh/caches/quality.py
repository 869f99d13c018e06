"""How much a press changed a cache, measured by the Mac that made it, so receivers can tell.

A shared cache is compressed before anyone knows the questions it will serve, so the measure must not
need them: the model re-reads the last tokens of its own context, once with the full cache and once
with the compressed one, and the mean KL divergence between its next-token distributions is the loss
("tail_kl", nats/token). It costs two forward passes of QUALITY_TOKENS tokens. It goes into the
manifest, where a receiver's quality floor (`ReceiverProfile.max_kl`) reads it.
"""

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn

from kvmesh.caches.kinds import fork

QUALITY_TOKENS = 32


def logprobs_given(model: nn.Module, cache: Sequence, probe: mx.array) -> mx.array:
    """The model's next-token log-probabilities over `probe` (1, n) given `cache`, which is left as
    it was (forks are fed)."""
    logits = model(probe, cache=[fork(c) for c in cache])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def mean_kl(reference: mx.array, other: mx.array) -> float:
    """Mean KL (nats/token) of the distributions `other` from `reference` (log-probabilities)."""
    kl: float = (mx.exp(reference) * (reference - other)).sum(axis=-1).mean().item()  # type: ignore[assignment]
    return kl


def tail_kl(model: nn.Module, dense: list, pressed: list, tokens: Sequence[int], *, n: int = QUALITY_TOKENS) -> float:
    """KL (nats/token) of the model's predictions given `pressed` from those given `dense` while it
    re-reads the last `n` of `tokens`; both caches are left as they were."""
    probe = mx.array(list(tokens[-n:]))[None]
    return mean_kl(logprobs_given(model, dense, probe), logprobs_given(model, pressed, probe))
