"""Agent loops over the native engine (ppo/agents/driver.py): single-turn equals batch generation, multi-turn
log-probs equal the trainer's, a sleeping tool does not stop the other trajectories' decoding."""

import time

import pytest
import torch

from ppo.agents.driver import DriveStats, Start, ToolPool, drive
from ppo.agents.loop import AgentTask, CallTool, Generate, ToolFailure, TrajectoryBuilder, single_turn
from ppo.data.tokenizer import CharTokenizer
from rollout import NativeEngine, SamplingParams
from tests.rollout.test_engine import PROMPTS, config, peaked_model, trainer_logprobs

_MODEL = []
TOK = CharTokenizer()
OBS = [[40, 41, 42], [50, 51, 52, 53, 54]]  # fixed observation tokens of the multi-turn loop


def model():
    if not _MODEL:
        torch.manual_seed(0)
        _MODEL.append(peaked_model())
    return _MODEL[0]


def task(prompt, max_response=40, total=96):
    return AgentTask(prompt_ids=list(prompt), row={"index": 0}, tokenizer=TOK, max_response_tokens=max_response,
                     max_total_tokens=total)


def three_turns(task):
    """Generate, observe OBS[0], generate, observe OBS[1], generate: 3 turns, 2 observations."""
    traj = TrajectoryBuilder(task.prompt_ids)
    for turn in range(3):
        traj.add_sampled((yield Generate(traj.token_ids, 6)))
        if turn < 2:
            traj.add_observation(OBS[turn])
    return traj.finish(text=None)


def sleepy_tool_loop(task):
    traj = TrajectoryBuilder(task.prompt_ids)
    traj.add_sampled((yield Generate(traj.token_ids, 2)))
    began = time.monotonic()
    result = yield CallTool(lambda: time.sleep(0.4) or "slept")
    traj.add_observation(TOK.encode(result))
    traj.add_sampled((yield Generate(traj.token_ids, 2)))
    return traj.finish(text=f"{began}:{time.monotonic()}")


def sampling():
    return SamplingParams(temperature=1.0, ignore_eos=True)


def test_single_turn_through_the_driver_equals_generate():
    engine = NativeEngine.from_model(model(), config=config())
    n, seeds = 3, [11, 12, 13, 14, 15]
    ref = engine.generate(PROMPTS, [SamplingParams(temperature=1.0, max_tokens=10, n=n, seed=s, ignore_eos=True)
                                    for s in seeds])
    starts = [Start(single_turn, task(p, max_response=10), seed, key=(i, j), sample=j)
              for i, (p, seed) in enumerate(zip(PROMPTS, seeds)) for j in range(n)]
    steps_before = engine.stats["prefill_steps"]
    trajs, stats = drive(engine, starts, sampling=sampling())
    assert engine.stats["prefill_steps"] - steps_before <= 2  # the n samples of a prompt share one prefill row
    for c, t in zip(ref, trajs):
        assert t.response_ids == c.token_ids and t.logprobs == c.logprobs and t.loss_mask is None
        assert t.turns == [(0, 10)] and t.text is None


@pytest.mark.parametrize("keep_kv", [False, True])
def test_multi_turn_logprobs_equal_the_trainer_at_every_sampled_token(keep_kv):
    engine = NativeEngine.from_model(model(), config=config())
    starts = [Start(three_turns, task(p), 100 + i, key=i) for i, p in enumerate(PROMPTS[:3])]
    trajs, stats = drive(engine, starts, sampling=sampling(), keep_kv=keep_kv)
    # kept KV: each later turn prefills the previous turn's last token and the observation only
    new = sum(map(len, PROMPTS[:3])) + 3 * (1 + len(OBS[0]) + 1 + len(OBS[1]))
    assert (stats.prefill_tokens == new) == keep_kv and stats.kv_misses == stats.kv_evictions == 0
    assert stats.prefill_tokens + stats.kv_reused_tokens == sum(
        3 * len(p) + 2 * 6 + len(OBS[0]) + 6 + len(OBS[0]) + len(OBS[1]) for p in PROMPTS[:3])
    assert engine._sched is None  # every session released when its loop returned
    for p, t in zip(PROMPTS, trajs):
        assert len(t.turns) == 3 and len(t.response_ids) == 18 + 3 + 5
        assert t.loss_mask == [1] * 6 + [0] * 3 + [1] * 6 + [0] * 5 + [1] * 6
        assert t.response_ids[6:9] == OBS[0] and t.response_ids[15:20] == OBS[1]
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        trainer = trainer_logprobs(model(), list(p), t.response_ids, 1.0)  # one forward over the whole trajectory
        torch.testing.assert_close(torch.tensor(t.logprobs)[mask], trainer[mask], atol=1e-5, rtol=0)
        assert (torch.tensor(t.logprobs)[~mask] == 0).all()


def test_a_sleeping_tool_does_not_stop_the_other_trajectories_decoding():
    engine = NativeEngine.from_model(model(), config=config())
    long_gen = Start(single_turn, task(PROMPTS[0], max_response=80, total=96), 1, key="long")
    sleepy = Start(sleepy_tool_loop, task(PROMPTS[1]), 2, key="tool")
    stats = DriveStats()
    pool = ToolPool(workers=2, timeout_s=5.0)
    t0 = time.monotonic()
    (long_traj, tool_traj), stats = drive(engine, [long_gen, sleepy], sampling=sampling(), tools=pool)
    pool.close()
    assert len(long_traj.response_ids) == 80 and long_traj.loss_mask is None
    assert tool_traj.loss_mask == [1, 1] + [0] * 5 + [1, 1]
    # decode steps of the long trajectory ran while the tool slept (measured by the driver)
    assert stats.steps_during_tools >= 10, stats
    began, ended = map(float, tool_traj.text.split(":"))
    assert ended - began >= 0.4 and time.monotonic() - t0 < 5


def test_a_tool_past_its_timeout_answers_a_failure():
    def slow(task):
        traj = TrajectoryBuilder(task.prompt_ids)
        result = yield CallTool(lambda: time.sleep(1.0))
        assert isinstance(result, ToolFailure) and "timed out" in result.error
        raise_error = yield CallTool(lambda: 1 / 0)
        assert isinstance(raise_error, ToolFailure) and "ZeroDivisionError" in raise_error.error
        return traj.finish(text="ok")

    pool = ToolPool(workers=2, timeout_s=0.2)
    engine = NativeEngine.from_model(model(), config=config())
    t0 = time.monotonic()
    (traj,), _ = drive(engine, [Start(slow, task(PROMPTS[0]), 0, key=0)], sampling=sampling(), tools=pool)
    pool.close()
    assert traj.text == "ok" and time.monotonic() - t0 < 0.9


def rank_0_tool_loop(rank: int, seed: int):
    """A loop of two turns, each followed by a tool whose answer ([rank + 40, 41]) and timing (jittered up to 50 ms,
    per rank) exist on rank 0 only: under generation TP the driver must agree rank 0's results (tp_tool_sync)."""
    import random

    jitter = random.Random(seed)

    def looped(task):
        traj = TrajectoryBuilder(task.prompt_ids)
        for _ in range(2):
            traj.add_sampled((yield Generate(traj.token_ids, 4)))
            traj.add_observation((yield CallTool(lambda: time.sleep(jitter.random() * 0.05) or [rank + 40, 41])))
        return traj.finish(text=None)

    return looped


def _tp_tools_body(rank, world_size):
    import torch.distributed as dist

    from parallel.sharding import tp_slices
    from ppo.agents.driver import tp_tool_sync

    torch.manual_seed(0)
    model = peaked_model(layers=2)
    engine = NativeEngine(model.config, config=config(), tp_group=dist.group.WORLD)
    engine.update_weights((n, t[tp_slices(n, tuple(t.shape), rank=rank, world=world_size)])
                          for n, t in model.state_dict().items())
    pool = ToolPool(workers=2, run_here=rank == 0)
    looped = rank_0_tool_loop(rank, seed=rank)
    starts = [Start(looped, task(p), 300 + i, key=i) for i, p in enumerate(PROMPTS[:3])]
    trajs, stats = drive(engine, starts, sampling=sampling(), tools=pool, sync=tp_tool_sync(dist.group.WORLD),
                         keep_kv=True)  # every rank parks and continues the same sessions
    assert stats.kv_reused_tokens > 0
    pool.close()
    return [(t.response_ids, t.logprobs) for t in trajs]


@pytest.mark.distributed
def test_generation_tp_ranks_get_rank_0s_tool_results():
    from tests.dist_utils import run_world

    a, b = run_world(_tp_tools_body, 2)
    assert [r for r, _ in a] == [r for r, _ in b]  # rank 1 ran no tool, yet decoded the same trajectories
    assert all(r[4:6] == [40, 41] for r, _ in a)


def test_single_turns_take_no_session_with_keep_kv():
    # plain generation never continues: a finished sample frees its slot at once (nothing parked, as without keep_kv)
    engine = NativeEngine.from_model(model(), config=config())
    starts = [Start(single_turn, task(PROMPTS[0], max_response=6), 7, key=(0, j), sample=j) for j in range(3)]
    parked = []
    step = engine.step

    def watched():
        out = step()
        parked.append(len(engine._sched.parked) if engine._sched is not None else 0)
        return out

    engine.step = watched
    _, stats = drive(engine, starts, sampling=sampling(), keep_kv=True)
    assert max(parked) == 0 and stats.kv_reused_tokens == 0 and engine._sessions == {}
