"""Agent loops: per-trajectory coroutines that turn a prompt into a trajectory of sampled and observation
tokens (docs/agents.md). `loop.py` the interface and the single-turn loop, `driver.py` runs many loops over one
rollout engine, `tools.py` tools and the hermes tool-call format, `tool_loop.py` the built-in tool loop."""
