"""A megatron runner's checkpoint in the native backend's saved format: a role trained with `<role>.backend=megatron`
resumes with `<role>.backend=native`, at the same layout or another.

    saved = [rank_states[r]["workers"]["actor"]["runner"] for r in ranks_that_held_the_actor]   # megatron's
    states = native_states(saved, runner.model_config, hparams=[...])   # native-format states, one per TP x PP shard
    state = reshard_runner_state(runner, optimizer, states)            # parallel/reshard_state.py: this rank's part

What a megatron rank saves (parallel/megatron_runner.py `checkpoint_state`): its stage's parameters under megatron
names, TP-local; its `layout` (tp / pp / dp coordinates, expert parallelism, the head); and, per distributed
optimizer, the fp32 master shard of each parameter it owns with Adam's step and moments and the `range` [start, end)
of the flattened TP-local parameter that shard covers (megatron's bucket `param_map[p]["param"]`). The data-parallel
ranks of one TP x PP coordinate together own each parameter's elements once.

The conversion, for each TP x PP coordinate: every parameter's master, exp_avg and exp_avg_sq put back together from
the DP ranks' flat ranges (an element no saved rank owns is an error), reshaped to the TP-local parameter, mapped to
Hugging Face names by models/megatron_map.py (fused qkv per KV group and gate/up split, tied heads, q/k norms: the
same exact mapping the weights take; Adam's state is element-wise, so the moments follow the weights' permutation),
and indexed as the native backend's chunks (`slices`: the TP shard's place in the full tensor). The result is the
state native ranks at tp = the saved tp, pp = the saved pp would have written, which parallel/reshard_state.py
loads into any native layout. Steps: megatron steps every parameter together; the one count is carried.

Before its first optimizer step a megatron rank saves no optimizer state: the parameters (fp32) are the masters
and the native optimizer starts fresh, as megatron's would. Refused (ConversionError naming what is missing): a
checkpoint written before the ranges and layout were saved, expert parallelism (ep > 1), a TP x PP coordinate
no saved rank held.
"""

from __future__ import annotations

import torch

from models.megatron_map import megatron_to_hf
from parallel.sharding import tp_shard_dim

MOMENTS = ("exp_avg", "exp_avg_sq")


class ConversionError(ValueError):
    """A megatron checkpoint that cannot become a native state; the message names the reason."""


def rank_layout(pgc, head: str) -> dict:
    """A megatron rank's coordinates as its checkpoint records them (`layout`)."""
    ep = getattr(pgc, "ep", None)
    return {"tp": pgc.tp.size(), "tp_rank": pgc.tp.rank(), "pp": pgc.pp.size(), "pp_rank": pgc.pp.rank(),
            "dp": pgc.dp.size(), "dp_rank": pgc.dp.rank(), "ep": ep.size() if ep is not None else 1, "head": head}


def why_not_convertible(saved: list[dict]) -> str | None:
    """Why these megatron rank states cannot become native ones (None: they can)."""
    if not saved:
        return "no saved rank holds this role's state"
    if not all("layout" in s for s in saved) or any("range" not in e for s in saved
                                                     for opt in s.get("dist_optim", []) for e in opt.values()):
        return ("it was written before megatron checkpoints recorded each rank's layout and the flat range of "
                "every fp32 master shard")
    if any(s["layout"]["ep"] > 1 for s in saved):
        return "its experts are split over expert-parallel ranks (ep > 1), which the conversion does not cover"
    lay = saved[0]["layout"]
    held = {(s["layout"]["pp_rank"], s["layout"]["tp_rank"]) for s in saved}
    lacking = [(p, t) for p in range(lay["pp"]) for t in range(lay["tp"]) if (p, t) not in held]
    if lacking:
        return f"no saved rank holds the (pp_rank, tp_rank) shards {lacking[:4]}"
    return None


def native_states(saved: list[dict], cfg, *, hparams: list[dict]) -> list[dict]:
    """Native-format runner states (parallel/runner.py `checkpoint_state`'s: params, slices, optim_names, optim),
    one per TP x PP coordinate of the megatron ranks `saved` (every rank that held the role), converted exactly.
    `cfg`: the model's ModelConfig; `hparams`: the optimizer's param-group settings to record (megatron's saved
    state has none)."""
    reason = why_not_convertible(saved)
    if reason:
        raise ConversionError(f"the megatron checkpoint cannot be converted for the native backend: {reason}")
    groups: dict[tuple[int, int], list[dict]] = {}
    for st in saved:
        groups.setdefault((st["layout"]["pp_rank"], st["layout"]["tp_rank"]), []).append(st)
    return [_native_state(group, cfg, hparams=hparams) for _, group in sorted(groups.items())]


def _unflatten(name: str, shape, parts: list[tuple[list[int], torch.Tensor]]) -> torch.Tensor:
    """The TP-local tensor `name` of `shape` from DP shards [(range [start, end) in the flat tensor, 1-D shard)]."""
    numel = int(torch.Size(shape).numel())
    flat = torch.empty(numel, dtype=parts[0][1].dtype)
    covered = torch.zeros(numel, dtype=torch.bool)
    for (start, end), t in parts:
        if t.numel() != end - start or end > numel:
            raise ConversionError(f"{name}: a saved shard of {t.numel()} elements for the range [{start}, {end}) of "
                                  f"a {numel}-element parameter")
        flat[start:end] = t.reshape(-1)
        covered[start:end] = True
    if not bool(covered.all()):
        raise ConversionError(f"{name}: {int((~covered).sum())} of {numel} elements are in no saved optimizer "
                              f"shard (the checkpoint lacks data-parallel ranks that held them)")
    return flat.view(shape)


def _place(name: str, shard: torch.Tensor, *, tp: int, tp_rank: int) -> list[list[int]]:
    """[global shape, offsets] of an HF-named TP shard (parallel/sharding.py's split: even, contiguous)."""
    dim = tp_shard_dim(name)
    shape, offsets = list(shard.shape), [0] * shard.dim()
    if dim is not None and tp > 1:
        shape[dim] *= tp
        offsets[dim] = tp_rank * shard.shape[dim]
    return [shape, offsets]


def _native_state(group: list[dict], cfg, *, hparams: list[dict]) -> dict:
    """The native state of one TP x PP coordinate from its DP ranks' states."""
    lay = group[0]["layout"]
    params = group[0]["params"]  # every DP replica holds the whole TP-local parameters
    owned: dict[str, list[dict]] = {}
    for st in group:
        for opt in st.get("dist_optim", []):
            for name, entry in opt.items():
                owned.setdefault(name, []).append(entry)
    to_hf = lambda mc: megatron_to_hf(mc, cfg, tp=lay["tp"], pp=lay["pp"], pp_rank=lay["pp_rank"],  # noqa: E731
                                      head=lay["head"])
    if not owned:  # saved before the first optimizer step: the parameters are the masters, no Adam state yet
        hf = to_hf({n: p.float() for n, p in params.items()})
        return {"params": {n: t.clone() for n, t in hf.items()},
                "slices": {n: _place(n, t, tp=lay["tp"], tp_rank=lay["tp_rank"]) for n, t in hf.items()}}
    if set(owned) - set(params):
        raise ConversionError(f"the optimizer shards of stage {lay['pp_rank']} tp rank {lay['tp_rank']} hold "
                              f"parameters the model lacks: {sorted(set(owned) - set(params))[:4]}")
    if set(params) - set(owned):
        raise ConversionError(f"{sorted(set(params) - set(owned))[:4]} of stage {lay['pp_rank']} tp rank "
                              f"{lay['tp_rank']} are in no saved optimizer shard (the checkpoint lacks data-parallel "
                              f"ranks that held them)")
    steps = {float(e["step"]) for entries in owned.values() for e in entries}
    if len(steps) != 1:
        raise ConversionError(f"the saved optimizer shards have different step counts {sorted(steps)}")
    full = {key: {n: _unflatten(n, params[n].shape, [(e["range"], e[key]) for e in owned[n]]) for n in params}
            for key in ("param", *MOMENTS)}
    hf = {key: to_hf(mc) for key, mc in full.items()}
    names = list(hf["param"])
    step = next(iter(owned.values()))[0]["step"]
    optim_state = {i: {"step": step.detach().clone().float(), **{k: hf[k][n].clone() for k in MOMENTS}}
                   for i, n in enumerate(names)}
    groups = [{**h, "params": list(range(len(names))) if gi == 0 else []} for gi, h in enumerate(hparams)]
    return {"params": {n: hf["param"][n].clone() for n in names},
            "slices": {n: _place(n, hf["param"][n], tp=lay["tp"], tp_rank=lay["tp_rank"]) for n in names},
            "optim_names": names, "optim": {"state": optim_state, "param_groups": groups}}
