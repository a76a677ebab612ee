"""A reward with signal for an untrained tiny model (tests only): the share of digits in the response, so the
advantages are not all zero before any warm-up.

    reward.function=tests/ppo/signal_rewards.py:digit_share
"""

from __future__ import annotations


def digit_share(response, ground_truth, **extra):
    return sum(c.isdigit() for c in response) / max(1, len(response))
