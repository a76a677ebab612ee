"""Dynamo's recompiles with their reasons. A graph compiled again after the first step costs a measured step
seconds to minutes, and a count of graphs does not say which guard failed (a value read from `self`, a size that
changed): the reason is what fixes it. `recompile_log()` turns on torch's `recompiles` log artifact once per
process, unless TORCH_LOGS chooses the logs itself, and keeps each recompile's message; `take()` hands over the
new ones (the step's metrics count them, and rank 0 logs the first one's reason).

    log = recompile_log()      # None where TORCH_LOGS is set without `recompiles`
    reasons = log.take()       # ["Recompiling function _decode_fn in ...\\n    triggered by ...", ...]
"""

from __future__ import annotations

import logging
import os

ARTIFACT_LOGGER = "torch._dynamo.guards.__recompiles"  # torch._logging.getArtifactLogger(guards, "recompiles")
_installed: RecompileLog | None = None


class RecompileLog(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def take(self) -> list[str]:
        out, self.messages = self.messages, []
        return out


def recompile_log() -> RecompileLog | None:
    """The process's recompile log (installed on first use)."""
    global _installed
    if _installed is not None:
        return _installed
    chosen = os.environ.get("TORCH_LOGS")
    if chosen and "recompiles" not in chosen:
        return None  # the user's own log choice stands
    import torch._logging

    if not chosen:
        torch._logging.set_logs(recompiles=True)
    _installed = RecompileLog()
    logging.getLogger(ARTIFACT_LOGGER).addHandler(_installed)
    return _installed


def summary(message: str) -> str:
    """One line of a recompile message: the function and its first failed guard."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    guard = " ".join(next((ln[2:] for ln in lines if ln.startswith("- ")), "").split())
    return f"{lines[0] if lines else message}: {guard}"
