"""Prompts and rewards: datasets and their resumable sampler, tokenizers, built-in tasks, reward functions."""
