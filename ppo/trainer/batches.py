"""How the trainer draws a step's batch (ppo.trainer.step.PPOTrainer.draw_batch): generated now with the step's weights,
in DAPO's scored rounds until every group carries signal, or (partial rollouts) as the first complete groups of the
prompts in flight. The actor ranks generate; every rank receives the samples."""

from __future__ import annotations

import torch

from ppo.batch.experience import Experience, all_gather_objects, merge_results, share_samples
from ppo.batch.step_batch import overlong_penalties
from ppo.metrics.timing import StageTimer
from ppo.roles.generation import Generation


class BatchDrawing:
    """PPOTrainer's batch drawing (module docstring); reads the trainer's state, roles, settings, plan, loop and
    ahead."""

    def generate(self, step: int, timer: StageTimer, *, version: int | None = None, index_offset: int = 0
                 ) -> tuple[Experience, Generation]:
        """Draw the next prompts for step `step`'s batch, generate them on the actor ranks with the weights of
        policy version `version` (the step now running; default `step`: generated in its own step), share the
        samples with every rank. Returns the batch and this rank's generation report (empty off the actor
        ranks). index_offset numbers the prompts of a further generation round of the same step apart."""
        batch = self.state.next_prompts(step if version is None else version)
        if index_offset:
            batch = [dict(row, index=row["index"] + index_offset) for row in batch]
        gen = Generation([])
        if self.roles.rollout is not None:
            with timer("gen"):
                gen = self.roles.rollout.generate(batch, step=step, seed=self.settings.run.seed,
                                                  version=step if version is None else version)
            timer.carve("gen", "reshard", gen.reshard_s)  # gen is decoding; reshard its own stage
        return Experience(share_samples(gen.samples)), gen

    def generate_informative(self, step: int, timer: StageTimer) -> tuple[Experience, Generation, dict, dict]:
        """DAPO dynamic sampling: generation rounds (each scored at once) until the batch holds
        data.batch_size groups whose samples did not all score the same, at most
        algorithm.filter_groups.max_num_gen_batches rounds. -> (experience, the last round's generation
        report, the kept samples' reward results {"score": {uid: shaped score}, "reward_failed": ...},
        metrics)."""
        from ppo.algos.dapo import fill_informative_groups

        rewards: dict[str, dict[int, torch.Tensor]] = {}  # every round's reward results, by key
        last = [Generation([])]

        def draw(round_index: int):
            exp, last[0] = self.generate(step, timer, version=step,
                                         index_offset=round_index * self.settings.data.batch_size)
            mine = {}
            if self.roles.reward is not None:
                with timer("reward"):
                    mine = self.roles.reward.score(exp)
            merged = merge_results(mine)  # collective: every rank gets every sample's results
            merged["score"] = self.shape_scores(exp, merged["score"])
            for key, per_uid in merged.items():
                rewards.setdefault(key, {}).update(per_uid)
            return exp.samples, {uid: float(v) for uid, v in merged["score"].items()}

        filled = fill_informative_groups(draw, target_groups=self.settings.data.batch_size,
                                         max_rounds=self.loop.advantages.max_gen_rounds)
        kept = {key: {s.uid: per_uid[s.uid] for s in filled.samples} for key, per_uid in rewards.items()}
        return Experience(filled.samples), last[0], kept, filled.metrics

    def overlong_penalties(self, exp: Experience) -> torch.Tensor | None:
        """[B] DAPO soft overlong penalties of the samples (None unless algorithm.overlong_buffer.enable)."""
        return overlong_penalties(exp, self.loop.advantages, max_len=self.settings.generation.max_response_length)

    def shape_scores(self, exp: Experience, scores: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """{uid: score} plus the overlong penalty (unchanged without algorithm.overlong_buffer)."""
        pen = self.overlong_penalties(exp)
        return scores if pen is None else {s.uid: scores[s.uid] + p for s, p in zip(exp.samples, pen)}

    def draw_batch(self, step: int, timer: StageTimer) -> tuple[Experience, Generation, dict | None, dict]:
        """-> (the step's batch, this rank's generation report, reward results when DAPO's rounds scored the
        samples already (else None), sampling metrics)."""
        exp, gen, rewards, sampling_m = self.ahead.pop(), Generation([]), None, {}
        if exp is None and self.loop.advantages.filter_groups:
            exp, gen, rewards, sampling_m = self.generate_informative(step, timer)
        elif exp is None and self.loop.batches_in_flight > 1:
            exp, gen = self.generate_partial(step, timer)
        elif exp is None:
            exp, gen = self.generate(step, timer, version=step)
        return exp, gen, rewards, sampling_m

    def generate_partial(self, step: int, timer: StageTimer) -> tuple[Experience, Generation]:
        """rollout.batches_in_flight > 1: the first step draws that many batches of prompts, every later step one
        (replacing the data.batch_size groups trained); the actor ranks train the first complete groups, those
        admitted trainer.max_staleness steps ago first (ppo.roles.generation.RolloutRole.generate_partial).
        trainer.stale_policy=drop: those are not waited for; the ones not trained are dropped (recorded in the
        prompt ledger) and whole batches are drawn beyond the step's one until every replica holds its
        (batches_in_flight - 1) x quota groups again."""
        b, drop = self.settings.data.batch_size, self.loop.stale_policy == "drop"
        quota = b // self.plan.gen_dp
        # step 0 is never resumed into
        draws = self.loop.batches_in_flight if step == 0 else 1 + (self.refill_draws(quota) if drop else 0)
        batch = [dict(row, index=row["index"] + d * b) for d in range(draws)
                 for row in self.state.next_prompts(step)]
        gen = Generation([])
        if self.roles.rollout is not None:
            with timer("gen"):
                gen = self.roles.rollout.generate_partial(batch, step=step, seed=self.settings.run.seed, version=step,
                                                          quota=quota, due_before=step - self.loop.max_staleness + 1,
                                                          drop=drop)
            timer.carve("gen", "reshard", gen.reshard_s)
        if drop:
            self.state.record_dropped(step, [p for part in all_gather_objects(gen.dropped) for p in part])
        return Experience(share_samples(gen.samples)), gen

    def refill_draws(self, quota: int) -> int:
        """trainer.stale_policy=drop: the batches of prompts to draw beyond the step's one, so that the replica
        holding the fewest groups (after its drops) holds (batches_in_flight - 1) x quota again (a batch gives
        every replica `quota`). Collective over the world: the replicas' leaders report their counts."""
        r = self.roles.rollout
        mine = len(r.partial.groups) if r is not None and r.partial is not None and r.gen_tp_rank == 0 else None
        held = [h for h in all_gather_objects(mine) if h is not None]
        short = max(((self.loop.batches_in_flight - 1) * quota - h for h in held), default=0)
        return max(0, -(-short // quota))
