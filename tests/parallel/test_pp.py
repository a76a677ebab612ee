"""PP=2 equals PP=1: loss and parameter gradients, 1F1B and interleaved 1F1B, plus forward-only; a tied
embedding's two stage copies both get the tied weight's whole gradient (a Qwen3-shaped model)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import build_model, preset_config
from models.document_attention import DocumentAttention
from parallel.pipeline import PipelineRunner, build_stages, split_stage, stage_ids
from parallel.sharding import pp_stage_layers
from tests.dist_utils import run_world

B, T = 4, 12


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (B, T), generator=g)
    # two packed documents per row, of uneven lengths
    pos = torch.cat([torch.arange(5), torch.arange(T - 5)]).expand(B, T).contiguous()
    adv = torch.randn(B, T, generator=g)
    return ids, pos, adv


def _loss_terms(hidden, weight, ids, adv):
    """Token log-prob of the next id weighted by an advantage: a per-token extra, like PPO's."""
    logp = F.log_softmax((hidden[:, :-1] @ weight.t()).float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -(logp * adv[:, :-1]).sum() / (B * (T - 1))


def _build(tied: bool):
    if not tied:
        return build_model("tiny", seed=0)
    return build_model(preset_config("tiny-qwen3"), seed=0)


def _reference(tied: bool = False):
    model = _build(tied)
    ids, pos, adv = _batch()
    hidden = model.hidden_states(ids, pos, attn=DocumentAttention(pos))
    loss = _loss_terms(hidden, model.lm_head.weight, ids, adv)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, hidden.detach()


# (schedule, stages per rank, micro-batches, declared activation dtype or None = inferred by torch, tied)
CONFIGS = [("1f1b", 1, 2, None, False), ("1f1b", 1, 4, torch.float32, False),
           ("interleaved_1f1b", 2, 4, None, False), ("interleaved_1f1b", 2, 4, torch.float32, False),
           ("1f1b", 1, 2, torch.float32, True)]


def _run_config(rank, world, schedule, stages_per_rank, n_mb, act_dtype, tied):
    import torch.distributed as dist

    model = _build(tied)
    stages = build_stages(model, pp=world, pp_rank=rank, stages_per_rank=stages_per_rank,
                          attn_factory=DocumentAttention)
    runner = PipelineRunner(stages, pp_group=dist.group.WORLD, num_stages=world * stages_per_rank,
                            n_microbatches=n_mb, schedule=schedule, activation_dtype=act_dtype)
    ids, pos, adv = _batch()

    def loss_fn(hidden, mb):
        w = runner.last_module.lm_head.weight
        loss = _loss_terms(hidden, w, mb["ids"], mb["adv"])
        return loss, {"n": hidden.shape[0]}

    losses = runner.forward_backward_rows(ids if runner.has_first else None, position_ids=pos,
                                     extras={"ids": ids, "adv": adv}, loss_fn=loss_fn)
    grads = {n: p.grad.clone() for m in runner.modules for n, p in m.named_parameters()}
    hidden = runner.forward_rows(ids if runner.has_first else None, position_ids=pos)
    # a second step reuses the cached schedule and accumulates the same gradients again
    runner.forward_backward_rows(ids if runner.has_first else None, position_ids=pos,
                            extras={"ids": ids, "adv": adv}, loss_fn=loss_fn)
    grads2 = {n: p.grad.clone() for m in runner.modules for n, p in m.named_parameters()}
    return {"losses": [x.detach() for x in losses], "grads": grads, "grads2": grads2, "hidden": hidden,
            "metrics": runner.last_metrics}


def _pp_body(rank, world):
    # one world for every schedule: process start-up dominates these tests on 2 cores
    return [_run_config(rank, world, *cfg) for cfg in CONFIGS]


@pytest.mark.distributed
def test_pp2_equals_pp1():
    refs = {tied: _reference(tied) for tied in (False, True)}
    out = run_world(_pp_body, 2)
    for i, (schedule, _, n_mb, _, tied) in enumerate(CONFIGS):
        ref_loss, ref_grads, ref_hidden = refs[tied]
        if tied:  # the last stage's head copy must carry the tied weight's gradient, embedding part included
            ref_grads = {**ref_grads, "lm_head.weight": ref_grads["model.embed_tokens.weight"]}
        first, last = out[0][i], out[1][i]
        assert len(last["losses"]) == n_mb and first["losses"] == [], schedule
        # loss_fn normalises by the whole batch, so the micro-batch losses sum to the full loss
        torch.testing.assert_close(torch.stack(last["losses"]).sum(), ref_loss, rtol=1e-5, atol=1e-6)
        assert [m["n"] for m in last["metrics"]] == [B // n_mb] * n_mb
        torch.testing.assert_close(last["hidden"], ref_hidden, rtol=1e-5, atol=1e-5)
        assert first["hidden"] is None
        seen = set()
        for r in (first, last):
            for name, g in r["grads"].items():
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"{schedule} {name}")
                torch.testing.assert_close(r["grads2"][name], 2 * ref_grads[name], rtol=1e-4, atol=1e-6)
                seen.add(name)
        assert seen == set(ref_grads)


def test_split_stage_keeps_hf_names_and_layers():
    model = build_model("tiny", seed=0)
    num_layers = model.config.num_hidden_layers
    names = set()
    for s in range(3):
        stage = split_stage(build_model("tiny", seed=0), num_stages=3, stage=s)
        keys = [int(k) for k in stage.model.layers]
        assert keys == list(pp_stage_layers(num_layers, pp=3, stage=s))
        assert (stage.model.embed_tokens is not None) == (s == 0)
        assert (stage.lm_head is not None) == (s == 2)
        names |= {n for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    assert stage_ids(pp=2, pp_rank=1, stages_per_rank=2) == [1, 3]


def test_runner_rejects_bad_config():
    stages = build_stages(build_model("tiny", seed=0), pp=1, pp_rank=0, stages_per_rank=2)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        PipelineRunner(stages, pp_group=None, num_stages=2, n_microbatches=2, schedule="1f1b")
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        PipelineRunner(stages, pp_group=None, num_stages=2, n_microbatches=2, schedule="zb")


def test_split_stage_of_a_value_model_keeps_score_on_the_last_stage():
    from models.heads import LlamaForValue

    cfg = build_model("tiny", seed=0).config
    names = set()
    for s in range(2):
        stage = split_stage(LlamaForValue(cfg), num_stages=2, stage=s)
        assert (stage.score is not None) == (s == 1) and not hasattr(stage, "lm_head")
        names |= {n for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in LlamaForValue(cfg).named_parameters()}
