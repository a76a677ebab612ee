"""Run state: tokenizer, prompt stream, metrics sinks, checkpoints and resume."""
