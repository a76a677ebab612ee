"""Resume onto another layout end to end (torchrun on gloo): PPO written at tp=2 pp=2 on 4 ranks (colocated)
continues on 2 ranks at tp=2, on 4 ranks at dp=4 and in split placement (actor | critic on 2 ranks each), and its
next step's metrics equal the uninterrupted run's (the layouts differ in
float summation order only: tolerances of fp32 rounding), with the same prompts drawn once each.
`make test-extended` (about 4 min on 2 CPU cores)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.ppo.test_trainer import _ok, launch, metrics

OLD = ["actor.tp=2", "actor.pp=2", "critic.tp=2", "critic.pp=2", "ref.tp=2", "ref.pp=2"]
NEW = {"tp2": (2, ["actor.tp=2", "critic.tp=2", "ref.tp=2"]), "dp4": (4, []),
       "split": (4, ["placement.mode=split"])}  # actor + rollout on ranks 0-1, the other roles on 2-3
EXPECT = {"tp2": "onto tp=2 pp=1 dp=1 (2 ranks)", "dp4": "onto tp=1 pp=1 dp=4 (4 ranks)",
          "split": "onto tp=1 pp=1 dp=2, critic tp=1 pp=1 dp=2 on ranks 2-3 (4 ranks)"}
COMMON = ["algorithm.name=ppo", "trainer.save_every=1", "trainer.resume=auto"]
EXACT = ("step", "response_length/mean", "reward/mean", "actor/lr")
# whole-batch figures and the gradient norms (the losses' gradients before the step); the loss and value-prediction
# metrics are means over micro-batches, whose count follows the layout, so they are left out
CLOSE = ("actor/entropy", "actor/kl", "critic/explained_var", "actor/grad_norm", "critic/grad_norm")


def _draws(run) -> list[dict]:
    return [json.loads(x) for x in (run / "prompts.jsonl").read_text().splitlines()]


@pytest.mark.distributed
@pytest.mark.extended
def test_tp2_pp2_checkpoint_resumes_at_tp2_dp4_and_split_like_the_straight_run(tmp_path):
    _ok(launch(tmp_path, 4, "conf/ppo_tiny.yaml", "trainer.total_steps=2", "trainer.experiment_name=straight",
               *COMMON, *OLD))
    _ok(launch(tmp_path, 4, "conf/ppo_tiny.yaml", "trainer.total_steps=1", "trainer.experiment_name=old",
               *COMMON, *OLD))
    straight = metrics(tmp_path / "straight")
    for name, (nproc, layout) in NEW.items():
        shutil.copytree(tmp_path / "old", tmp_path / name)
        _ok(launch(tmp_path, nproc, "conf/ppo_tiny.yaml", "trainer.total_steps=2", f"trainer.experiment_name={name}",
                   *COMMON, *layout))
        log = (tmp_path / name / "logs" / "rank_0.log").read_text()
        assert f"resuming step 1 written at tp=2 pp=2 dp=1 (4 ranks) {EXPECT[name]}" in log, log[-3000:]
        rows = metrics(tmp_path / name)
        assert [r["step"] for r in rows] == [1, 2]
        assert _draws(tmp_path / name) == _draws(tmp_path / "straight")  # the same prompts, once each
        for k in EXACT:
            assert rows[1][k] == straight[1][k], (name, k)
        for k in CLOSE:
            assert rows[1][k] == pytest.approx(straight[1][k], rel=1e-4, abs=1e-6), (name, k, rows[1][k])
