"""A native runner's checkpoint state, written at one layout, rebuilt for another (resume onto a new layout).

    saved = [rank_states[r]["workers"]["actor"]["runner"] for r in ranks_that_held_the_actor]
    state = reshard_runner_state(runner, optimizer, saved)     # this rank's state, as if saved at this layout
    runner.load_checkpoint_state(optimizer, state)

`NativeRunner.checkpoint_state` saves each parameter's local shard under its Hugging Face name together with
where that shard sits in the full tensor (`slices`: {name: [global shape, offsets]}, DCP's chunk metadata in
plain containers) and the optimizer's parameter order by name (`optim_names`). The fp32 master weights are
saved as the parameters, and AdamW's moments are laid out like them, so every tensor of the state is a
chunk of a known global tensor. Rebuilding this rank's state for another tp / pp / dp / FSDP layout reads,
for each of its parameters, the region it now holds (`parallel.loading.local_slices`) out of whichever saved
chunks overlap it; replicas (dp, or tp-replicated norms) hold the same values and any one serves. Step
counts come from any saved chunk (every shard of a parameter steps together).

A tied embedding / head at pp > 1 exists twice (the first stage's embedding, the last stage's head copy,
stepped alike); a layout that holds only one name serves the other from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parallel.loading import local_slices

TIED = {"lm_head.weight": "model.embed_tokens.weight", "model.embed_tokens.weight": "lm_head.weight"}
MOMENTS = ("exp_avg", "exp_avg_sq")


class ReshardError(ValueError):
    """The saved chunks cannot rebuild this layout's state (a region no chunk holds, another model, an optimizer
    of another kind); the message names the tensor and what is missing."""


def chunk_index(named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, list[list[int]]]:
    """{name: [global shape, offsets]} of each (possibly DTensor) parameter's local shard."""
    return {n: [list(p.shape), [s.start or 0 for s in local_slices(p)]] for n, p in named}


def is_reshardable(state: dict) -> bool:
    """Whether a runner's saved state carries its chunk index (native runners since resume onto other layouts)."""
    return "slices" in state


def assemble(name: str, *, shape: Sequence[int], region: Sequence[slice], chunks: list[tuple[list, torch.Tensor]],
             dtype: torch.dtype) -> torch.Tensor:
    """The `region` of the full tensor `name` (global `shape`) from saved `chunks` [(offsets, local tensor)].

    Raises ReshardError when some element of the region is in no chunk."""
    starts = [s.start or 0 for s in region]
    stops = [s.stop if s.stop is not None else n for s, n in zip(region, shape)]
    out = torch.empty([b - a for a, b in zip(starts, stops)], dtype=dtype)
    covered = torch.zeros(out.shape, dtype=torch.bool)
    for offsets, t in chunks:
        lo = [max(a, o) for a, o in zip(starts, offsets)]
        hi = [min(b, o + n) for b, o, n in zip(stops, offsets, t.shape)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        src = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))
        dst = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, starts))
        out[dst] = t[src].to(dtype)
        covered[dst] = True
    if not bool(covered.all()):
        raise ReshardError(f"{name}: {int((~covered).sum())} of {covered.numel()} elements of this rank's region "
                           f"{[(a, b) for a, b in zip(starts, stops)]} are in no saved shard (the checkpoint lacks "
                           f"ranks that held them)")
    return out


def _chunks_of(saved: list[dict], name: str, shape: list[int], pick) -> tuple[str, list]:
    """(the saved name serving `name`, [(offsets, tensor)]) over every saved rank; pick(state, name): tensor or None."""
    for source in (name, TIED.get(name)):
        found = []
        for st in saved:
            entry = st["slices"].get(source) if source else None
            if entry is None or list(entry[0]) != list(shape):
                continue
            t = pick(st, source)
            if t is not None:
                found.append((list(entry[1]), t))
        if found:
            return source, found
    return name, []


def _optim_entry(st: dict, name: str) -> dict | None:
    """The saved AdamW state of parameter `name` in one rank's state (None: not held there, or never stepped)."""
    optim, names = st.get("optim"), st.get("optim_names", [])
    if optim is None or name not in names:
        return None
    entry = optim["state"].get(names.index(name))
    return entry if entry and "step" in entry else None


def _moment(key: str):
    def pick(st: dict, name: str) -> torch.Tensor | None:
        entry = _optim_entry(st, name)
        return entry.get(key) if entry is not None else None
    return pick


def reshard_runner_state(runner, optimizer, saved: list[dict]) -> dict:
    """This rank's `runner.checkpoint_state(optimizer)` rebuilt from the states `saved` by every rank that held
    the role at another layout (each with its chunk index): parameters (fp32 masters where saved) and AdamW's
    step and moments, as local shards in this rank's placements. Collective-free (reads tensors only)."""
    if not saved:
        raise ReshardError("no saved rank holds this role's state")
    if not all(is_reshardable(s) for s in saved):
        raise ReshardError("the checkpoint's runner state has no chunk index (written by the megatron backend, or "
                           "before resume onto other layouts): it loads only at the layout that wrote it")
    named = list(runner.named_parameters())
    params = {}
    for name, p in named:
        source, chunks = _chunks_of(saved, name, list(p.shape), lambda st, n: st["params"].get(n))
        if not chunks:
            raise ReshardError(f"{name} (shape {list(p.shape)}) is in no saved shard of this role: the checkpoint is "
                               f"of another model")
        params[name] = assemble(source, shape=p.shape, region=local_slices(p), chunks=chunks,
                                dtype=chunks[0][1].dtype)
    state = {"params": params}
    if optimizer is None or all("optim" not in s for s in saved):
        return state
    live_names = {id(p): n for n, p in named}
    order = [p for g in optimizer.param_groups for p in g["params"]]
    hparams = [{k: v for k, v in g.items() if k != "params"} for g in next(s for s in saved if "optim" in s)
               ["optim"]["param_groups"]]
    if len(hparams) != len(optimizer.param_groups) and len({repr(sorted(h.items())) for h in hparams}) != 1:
        raise ReshardError(f"the checkpoint's optimizer has {len(hparams)} parameter groups with different "
                           f"settings, this run builds {len(optimizer.param_groups)}")
    opt_state = {}
    for idx, p in enumerate(order):
        name = live_names[id(p)]
        _, entries = _chunks_of(saved, name, list(p.shape), _optim_entry)
        if not entries:
            continue  # the saved optimizer had not stepped this parameter: no state, as AdamW
        st = {"step": entries[0][1]["step"].clone()}
        for k in MOMENTS:
            source, chunks = _chunks_of(saved, name, list(p.shape), _moment(k))
            st[k] = assemble(source, shape=p.shape, region=local_slices(p), chunks=chunks,
                             dtype=chunks[0][1].dtype)
        opt_state[idx] = st
    groups, start = [], 0
    for gi, g in enumerate(optimizer.param_groups):
        groups.append({**hparams[min(gi, len(hparams) - 1)], "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    state["optim"] = {"state": opt_state, "param_groups": groups}
    return state
