"""A GRPO step whose samples are multi-turn trajectories of a user's loop file (agent.loop_file), in one
process: the trainer's fp32 log-probs of every sampled token equal the engine's across turns, the agent
metrics are reported, samples.jsonl shows the whole conversation."""

import json
import textwrap

from tests.ppo.world import tiny_run, world_of_one

LOOPS = textwrap.dedent('''
    from ppo.agents.loop import Generate, TrajectoryBuilder

    def two_turns(task):
        traj = TrajectoryBuilder(task.prompt_ids)
        traj.add_sampled((yield Generate(traj.token_ids, 3)))
        traj.add_observation(task.tokenizer.encode("|obs|"))
        traj.add_sampled((yield Generate(traj.token_ids, 3)))
        return traj.finish(text=task.tokenizer.decode(traj.response_ids[-3:]))

    AGENT_LOOPS = {"two_turns": two_turns}
''')


def test_grpo_step_on_two_turn_trajectories(tmp_path):
    loops = tmp_path / "loops.py"
    loops.write_text(LOOPS)
    with world_of_one():
        run = tiny_run(tmp_path / "run", f"agent.loop_file={loops}", "agent.default=two_turns",
                       "rollout.max_response_length=16", "actor.mini_batch_size=16", "trainer.log_samples_every=1",
                       "rollout.temperature=1.0", config="conf/grpo_tiny.yaml")
        (tmp_path / "out").mkdir()
        trainer = run.trainer(tmp_path / "out")
        assert trainer.old_logp_source() == "fused_first"
        m = trainer.step(0)
    assert m["agent/turns_mean"] == 2 and m["agent/observation_tokens_mean"] == 5
    assert m["agent/sampled_tokens_mean"] <= 6 and m["agent/tool_calls_mean"] == 0
    # the engine's behaviour log-probs and the trainer's (the first mini-batch's update forward, the second's forward
    # before the update), over the sampled tokens of both turns
    assert m["rollout_corr/logprob_diff_max"] <= 1e-5
    assert m["response_length/mean"] == m["agent/sampled_tokens_mean"]  # observation tokens are not response
    rows = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert rows and all("|obs|" in r["response"] and r["turns"] == 2 for r in rows)
