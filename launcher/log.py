"""Rank-aware logging: rank 0 prints INFO to stdout, every rank prints warnings and errors to
stderr, and every rank writes everything to `<run_dir>/logs/rank_<r>.log`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

LOGGER_NAME = "hybridrl"


def setup_logging(*, rank: int, world_size: int, log_dir: Path | None = None, level: int = logging.INFO):
    logger = logging.getLogger(LOGGER_NAME)
    logger.handlers.clear()
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    width = len(str(max(world_size - 1, 0)))
    fmt = logging.Formatter(f"[%(asctime)s rank {rank:>{width}}] %(levelname)s %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    console.setLevel(level if rank == 0 else logging.WARNING)
    console.setFormatter(fmt)
    logger.addHandler(console)
    if log_dir is not None:
        add_file_log(logger, log_dir, rank=rank, fmt=fmt)
    return logger


def add_file_log(logger: logging.Logger, log_dir: Path, *, rank: int, fmt: logging.Formatter | None = None):
    log_dir.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(log_dir / f"rank_{rank}.log")
    fh.setLevel(logging.DEBUG)
    fh.setFormatter(fmt or logger.handlers[0].formatter)
    logger.addHandler(fh)


def log_to_files(level: int, message: str) -> None:
    """`message` into the run directory's log files only (logs/rank_<r>.log; none before the run directory
    exists): a stop reason printed on stderr lands in the log too, without printing it twice."""
    logger = get_logger()
    record = logger.makeRecord(logger.name, level, __file__, 0, message, (), None)
    for h in logger.handlers:
        if isinstance(h, logging.FileHandler):
            h.handle(record)


def get_logger() -> logging.Logger:
    return logging.getLogger(LOGGER_NAME)
