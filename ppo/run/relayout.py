"""Resume onto another layout: a checkpoint written at one world size, placement and tp/pp/dp loads into another.

    if is_relayout(saved_layout, saved_world, current_layout, world):
        rank_states = load_rank_states(path, world_size=saved_world)     # every saved rank's file (memory-mapped)
        check_relayout(path, rank_states, roles)                        # ResumeError (exit 2) when it cannot
        log.info(describe_relayout(step, saved_layout, saved_world, current_layout, world))
        load_roles_resharded(roles, rank_states)
        seed_rng(seed, step=step, rank=rank)

What moves: each native runner's parameters (fp32 masters where kept) and AdamW moments, rebuilt for this
rank's shards from whichever saved shards overlap them (parallel/reshard_state.py); the LR schedule (the same
on every rank); the shared state (sampler position, KL and batch controllers, batches generated ahead) as
at the same layout, so the prompt ledger continues where it stopped and no prompt is trained twice or skipped.

RNG rule: at the same layout each rank restores its own saved streams (bit-exact resume). At another layout
the saved per-rank streams no longer belong to any rank, so every rank's Python, numpy and torch (CPU and
CUDA) generators are re-seeded from (trainer.seed, step, rank). Nothing of a step's numbers draws from them:
generation seeds each request from (seed, step, prompt index) (ppo.roles.generation.request_seed) and the
sampler owns its generator, so a resumed run on the new layout reproduces from the same state.

A role trained with `<role>.backend=megatron` and resumed with `<role>.backend=native` (at this layout or
another) takes this path too: its megatron rank states (parameters, the fp32 master shards of megatron's
distributed optimizer with their flat ranges, Adam's step and moments) are converted into the native format first
(parallel/megatron_checkpoint.py), then resharded as above; the LR the schedule last set carries over.

Refused (ResumeError, exit 2, saying what to do): a megatron role at another layout with the megatron backend, and
a native role resumed with megatron (megatron's distributed optimizer keeps its fp32 master shards and moments in
its own per-rank bucket layout, and rebuilding that needs megatron's optimizer, CUDA only); a megatron checkpoint
written before it recorded its layout and shard ranges, or with expert parallelism; groups of partial rollouts in flight
(rollout.batches_in_flight > 1: they are bound to the generation ranks that hold them); a checkpoint written
before runner states carried their chunk index.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

import numpy as np
import torch

from ppo.run.resume import ResumeError

TRAINED = ("actor", "critic")


def is_relayout(saved_layout: dict | None, saved_world: int, current_layout: dict | None, world: int) -> bool:
    """Whether the checkpoint was written at another world size or device plan than this run's."""
    return saved_world != world or (saved_layout is not None and current_layout is not None
                                    and saved_layout != current_layout)


def _dims(entry) -> str:
    _, tp, pp, dp = entry
    return f"tp={tp} pp={pp} dp={dp}"


def _ranks(entry) -> str:
    ranks = entry[0]
    return f"ranks {ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"


def describe_layout(layout: dict, world: int) -> str:
    """'tp=2 pp=2 dp=1 (4 ranks)': the actor's layout; a critic laid out otherwise, or on other ranks, is named
    (the roles whose state is resharded; generation and frozen roles follow the plan)."""
    trained = {role: entry for role, entry in layout.items() if role in TRAINED}
    if not trained:
        return f"({world} ranks)"
    main = trained.get("actor") or next(iter(trained.values()))
    parts = [_dims(main)]
    for role, entry in sorted(trained.items()):
        if entry is main or role == "actor":
            continue
        if entry[1:] != main[1:] or entry[0] != main[0]:
            parts.append(f"{role} {_dims(entry)} on {_ranks(entry)}")
    return f"{', '.join(parts)} ({world} ranks)"


def describe_relayout(step: int, saved: dict, saved_world: int, current: dict, world: int, *,
                      converted: Sequence[str] = ()) -> str:
    """The log line of a resume onto another layout (`converted`: roles whose megatron state becomes native)."""
    conversion = "".join(f", the {name}'s megatron state converted for the native backend" for name in converted)
    return (f"resuming step {step} written at {describe_layout(saved, saved_world)} onto "
            f"{describe_layout(current, world)}: parameters, fp32 masters and Adam moments resharded{conversion}, the "
            f"data position carried, per-rank RNG re-seeded from (seed, step, rank)")


def _backend(state: dict) -> str:
    """The backend that wrote a worker's state (a checkpoint from before it was recorded: by its parameter names)."""
    if "backend" in state:
        return state["backend"]
    names = state.get("runner", {}).get("params", {})
    return "megatron" if any(n.startswith(("decoder.", "embedding.")) for n in names) else "native"


def check_relayout(path, rank_states: list[dict], roles, *, saved_desc: str) -> None:
    """Raise ResumeError naming the reason and the way out when this checkpoint cannot load at this layout.
    Every rank checks the same saved states and its own roles; the caller gathers the verdicts."""
    saved_roles = {name: [st["workers"][name] for st in rank_states if name in st["workers"]]
                   for name in {n for st in rank_states for n in st["workers"]}}
    way_out = (f"resume with the layout that wrote it ({saved_desc}), or start a new run (another "
               f"trainer.experiment_name) from its Hugging Face weights: model.path={path}/actor (written at the "
               f"final step, or at every save with trainer.export_hf=every_save)")
    if "rollout" in saved_roles:
        raise ResumeError(f"checkpoint {path} holds partial rollouts in flight (rollout.batches_in_flight > 1), "
                          f"bound to the generation ranks that started them: {way_out}")
    for name in TRAINED:
        worker, saved = getattr(roles, name, None), saved_roles.get(name, [])
        if worker is None:
            continue
        if not saved:
            raise ResumeError(f"checkpoint {path} holds no {name} state, this run trains a {name}: {way_out}")
        live = getattr(worker.runner, "backend", "native")
        backends = {_backend(s) for s in saved}
        if backends == {"megatron"} and live == "native":
            from parallel.megatron_checkpoint import why_not_convertible

            reason = why_not_convertible([s["runner"] for s in saved])
            if reason:
                raise ResumeError(f"checkpoint {path}: the {name} was trained with {name}.backend=megatron and its "
                                  f"state cannot be converted for {name}.backend=native: {reason}: {way_out}")
            continue
        if backends != {"native"} or live != "native":
            raise ResumeError(
                f"checkpoint {path}: the {name} was trained with {name}.backend={'/'.join(sorted(backends))} and "
                f"resumes with {name}.backend={live} at another layout; megatron's distributed optimizer keeps its "
                f"fp32 master shards and Adam moments in its own per-rank bucket layout, which only the layout that "
                f"wrote it loads with the megatron backend (rebuilding it needs megatron's optimizer, CUDA only); a "
                f"megatron checkpoint converts into the native backend at any layout ({name}.backend=native): "
                f"{way_out}")
        if not all("slices" in s["runner"] for s in saved):
            raise ResumeError(f"checkpoint {path} was written before runner states carried their shard index; "
                              f"it loads only at its own layout: {way_out}")


def converted_roles(workers: dict, roles) -> list[str]:
    """The trained roles of this rank whose saved state the megatron backend wrote and which resume with the native
    one: their state is converted (on the relayout path, which reads every saved rank), whatever the layout."""
    return [name for name in TRAINED
            if getattr(roles, name, None) is not None and name in workers
            and _backend(workers[name]) == "megatron"
            and getattr(getattr(roles, name).runner, "backend", "native") == "native"]


def check_same_backend(path, workers: dict, roles) -> None:
    """At the same layout: each trained role resumes with the backend that wrote its state, or converts megatron's
    into the native backend (`converted_roles`); ResumeError naming both for native -> megatron (building
    megatron's distributed optimizer state from native shards needs megatron's optimizer, CUDA only)."""
    for name in TRAINED:
        worker, saved = getattr(roles, name, None), workers.get(name)
        if worker is None or saved is None:
            continue
        live, was = getattr(worker.runner, "backend", "native"), _backend(saved)
        if live != was and not (was == "megatron" and live == "native"):
            raise ResumeError(
                f"checkpoint {path}: the {name} was trained with {name}.backend={was}, this run sets {live}; "
                f"{was}'s optimizer state does not convert into {live}'s: resume with {name}.backend={was}, or start "
                f"a new run (another trainer.experiment_name) from its Hugging Face weights: "
                f"model.path={path}/{name} (written at the final step, or at every save with "
                f"trainer.export_hf=every_save)")


def load_roles_resharded(roles, rank_states: list[dict]) -> None:
    """This rank's actor and critic (runner state and LR schedule, the same on every rank) from every saved rank's
    shards (a megatron-trained role resuming with the native backend: converted first)."""
    from parallel.reshard_state import reshard_runner_state

    for name in TRAINED:
        worker = getattr(roles, name, None)
        if worker is None:
            continue
        saved = [st["workers"][name] for st in rank_states if name in st["workers"]]
        optimizer = getattr(worker, "optimizer", None)
        runner_states = [s["runner"] for s in saved]
        if _backend(saved[0]) == "megatron":
            runner_states = _native_from_megatron(worker, runner_states, sched=saved[0].get("sched"))
        worker.runner.load_checkpoint_state(optimizer, reshard_runner_state(worker.runner, optimizer, runner_states))
        if "sched" in saved[0] and getattr(worker, "scheduler", None) is not None:
            worker.scheduler.load_state_dict(saved[0]["sched"])


def _native_from_megatron(worker, runner_states: list[dict], *, sched: dict | None) -> list[dict]:
    """Megatron rank states as native ones (parallel/megatron_checkpoint.py), their optimizer groups this run's
    settings at the LR the saved schedule last set (megatron saves no group settings; a native checkpoint's groups
    carry that LR, which the next step uses before the schedule moves it)."""
    from parallel.megatron_checkpoint import native_states

    optimizer = getattr(worker, "optimizer", None)
    groups = optimizer.param_groups if optimizer is not None else []
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    last_lr = (sched or {}).get("_last_lr") or []
    for h, lr in zip(hparams, last_lr if len(last_lr) == len(hparams) else []):
        h["lr"] = lr
    return native_states(runner_states, worker.runner.model_config, hparams=hparams)


def seed_rng(seed: int, *, step: int, rank: int) -> None:
    """Every RNG of this process re-seeded from (seed, step, rank): the rule at another layout (module doc)."""
    h = int.from_bytes(hashlib.blake2b(f"rng/{seed}/{step}/{rank}".encode(), digest_size=8).digest(), "little")
    random.seed(h)
    np.random.seed(h % 2**32)
    torch.manual_seed(h % 2**63)  # CUDA's generators too
