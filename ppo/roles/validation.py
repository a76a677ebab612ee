"""Validation on `data.val_files`: generate, score with the run's reward, report per data source.

    trainer.val_before_train=true     once before the first RL step (after any SFT warm-up)
    trainer.test_freq=N               every N steps, and after the last step (0: after the last only)
    rollout.val_n / val_temperature   samples per prompt and their temperature (default 1, greedy)

Metrics (in metrics.jsonl, TensorBoard and `python -m launcher.report`'s validation.png), with k
in {1, val_n}; a sample is solved when its score >= reward.pass_threshold:

    val/reward/mean  val/pass@k                          over every validation prompt
    val/<data_source>/reward/mean  val/<data_source>/pass@k   per data source
    val/reward/<key>/mean                                each numeric extra key of dict rewards
    val/reward/failed                                    samples whose reward call failed (rule rewards)

pass@k is the unbiased estimator of Chen et al. (2021) over the val_n samples of each prompt.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from math import comb

import torch

from ppo.batch.experience import Experience, merge_results, share_samples


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c of them
    correct) is correct: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c({c}) <= n({n}) and 1 <= k({k}) <= n")
    return 1.0 - comb(n - c, k) / comb(n, k)


def validation_metrics(groups: list[tuple[str, list[float]]], *, threshold: float,
                       extras: dict[str, list[float]] | None = None) -> dict[str, float]:
    """groups: one (data_source, [score of each sample]) per prompt, every prompt with the same number
    of samples n. -> val/reward/mean, val/pass@1, val/pass@n, and the same per data source."""
    if not groups:
        return {}
    n = len(groups[0][1])
    ks = sorted({1, n})
    by_source: dict[str, list[list[float]]] = defaultdict(list)
    for source, scores in groups:
        if len(scores) != n:
            raise ValueError(f"every validation prompt needs {n} samples, one has {len(scores)}")
        by_source[source].append(scores)

    def summarise(prefix: str, prompts: list[list[float]]) -> dict[str, float]:
        m = {f"{prefix}reward/mean": sum(map(sum, prompts)) / (n * len(prompts))}
        for k in ks:
            solved = [sum(s >= threshold for s in p) for p in prompts]
            m[f"{prefix}pass@{k}"] = sum(pass_at_k(n, c, k) for c in solved) / len(prompts)
        return m

    out = summarise("val/", [s for _, s in groups])
    for source, prompts in sorted(by_source.items()):
        out.update(summarise(f"val/{source or 'unknown'}/", prompts))
    for key, values in (extras or {}).items():
        if values:
            out[f"val/reward/{key}/mean"] = sum(values) / len(values)
    return out


def validation_batch(dataset) -> list[dict]:
    """Every validation prompt as the rows `RolloutRole.generate` takes (index = position)."""
    return [dict(index=i, **dataset.row(i)) for i in range(len(dataset))]


def run_validation(roles, dataset, *, step: int, seed: int, val_n: int, temperature: float,
                   threshold: float, rank: int) -> dict[str, float]:
    """Generate val_n samples per validation prompt on the rollout ranks, score them on the reward
    ranks, and return the metrics on rank 0 ({} elsewhere). Collective: every rank calls it."""
    mine = []
    if roles.rollout is not None:
        # a seed stream apart from training's (negative steps), so validation never shifts training's samples
        mine = roles.rollout.generate(validation_batch(dataset), step=-(step + 1), seed=seed, n=val_n,
                                      temperature=temperature).samples
    exp = Experience(share_samples(mine))
    merged = merge_results(roles.reward.score(exp) if roles.reward is not None else {})
    if rank != 0:
        return {}
    scores = merged["score"]
    per_prompt: dict[int, list[float]] = defaultdict(list)
    for s in exp.samples:
        per_prompt[s.prompt_index].append(float(scores[s.uid]))
    groups = [(dataset[i].data_source, per_prompt[i]) for i in sorted(per_prompt)]
    extras = {k[len("reward/"):]: [float(v) for v in per_uid.values()]
              for k, per_uid in merged.items() if k.startswith("reward/")}
    m = validation_metrics(groups, threshold=threshold, extras=extras)
    m["val/response_length/mean"] = float(torch.tensor([len(s.response_ids) for s in exp.samples]).float().mean())
    if "reward_failed" in merged:  # a rule reward's failed calls score reward.default_score: counted, not hidden
        failed = int(sum(float(v) for v in merged["reward_failed"].values()))
        m["val/reward/failed"] = float(failed)
        if failed:
            logging.getLogger("hybridrl").warning(
                "validation after step %d: the reward function failed on %d of %d samples (scored "
                "reward.default_score; val/reward/failed; the errors are logged above)", step, failed,
                len(exp.samples))
    return m
