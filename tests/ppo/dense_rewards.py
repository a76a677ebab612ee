"""A dense reward for short end-to-end runs (tests only): every response scores, so the policy moves from the first
step even where the synthetic task's exact-match reward is 0 for every sample of an untrained model."""

from __future__ import annotations


def digit_fraction(response: str, ground_truth=None, **extra) -> float:
    """The fraction of the response's characters that are digits."""
    return sum(c.isdigit() for c in response) / max(1, len(response))
