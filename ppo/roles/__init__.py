"""The roles a rank hosts (actor, rollout, reference, critic, reward), their workers and what they compute."""
