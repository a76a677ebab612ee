"""Settings left unset (None) resolved at start-up from the device and the roles: fast where it is safe,
each choice with its reason, and an explicit setting always wins.

    choices = resolve_auto(cfg)     # after validation; -> ["actor.compile=true (auto: ...)", ...]

Resolved values go into the run directory's config.yaml, so a run records what it ran with; rank 0 logs
each choice as one line (launcher/main.py).
"""

from __future__ import annotations

from launcher.config.schema import Config


def on_cuda(cfg: Config) -> bool:
    """Whether the run trains on CUDA: trainer.device=cuda, or auto with a GPU visible."""
    if cfg.trainer.device == "cuda":
        return True
    if cfg.trainer.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def resolve_auto(cfg: Config) -> list[str]:
    """Fill every unset speed setting of `cfg` in place. -> one line per choice: key=value (auto: why)."""
    cuda = on_cuda(cfg)
    choices = []

    def choose(key: str, value, why: str) -> None:
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
        choices.append(f"{key}={str(value).lower()} (auto: {why})")

    for role in ("actor", "critic", "ref", "reward"):
        sec = getattr(cfg, role)
        if sec.compile is not None:
            continue
        if role == "reward" and cfg.reward.type == "rule":
            sec.compile = False  # a rule reward has no model (no line: nothing to choose)
        elif not cuda:
            choose(f"{role}.compile", False, "no CUDA device: torch.compile's CPU kernels are slower to build than "
                                             "they save on a tiny model")
        elif sec.backend == "megatron" and sec.activation_checkpointing == "full":
            choose(f"{role}.compile", False, "megatron's full recompute wraps the layers itself")
        else:
            choose(f"{role}.compile", True, "CUDA: each transformer layer compiled (fused norms, RoPE, SiLU)")
    r = cfg.rollout
    if r.compile is None:
        if not cuda:
            choose("rollout.compile", False, "no CUDA device")
        elif r.engine != "native":
            choose("rollout.compile", False, f"rollout.engine={r.engine} compiles with its own settings")
        else:
            choose("rollout.compile", True, "CUDA: the native engine's decode forward compiled into its CUDA graphs")
    return choices
