"""The runner interface: LocalRunner (pp = 1, here also FSDP dp = 2) and PipelineRunner (pp = 2)
give the single-process LocalRunner's forward results, losses, clipped gradients and grad norm and
HF export, over the same packed micro-batches of different lengths; also for a tied-embedding Qwen3
at pp = 2 (both stage copies get the whole gradient, counted once in the norm, and stay equal), and
for a TP = 2 critic (DTensor trunk beside a plain score head: its clipped gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import build_model
from models.document_attention import DocumentAttention
from models.heads import LlamaForValue
from parallel.native_runner import LocalRunner
from parallel.runner import MicroBatch
from tests.dist_utils import run_world


def _batches() -> list[MicroBatch]:
    g = torch.Generator().manual_seed(3)
    out = []
    for docs in ([5, 4], [7], [3, 3, 2], [6]):  # packed rows of uneven lengths and document counts
        ids = torch.randint(1, 512, (1, sum(docs)), generator=g)
        pos = torch.cat([torch.arange(n) for n in docs])[None]
        out.append(MicroBatch(ids, pos))
    return out


def _logp(runner, hidden, mb):
    """Next-token log-probs of one micro-batch [T-1] through the runner's (vocab-slice) head."""
    w, start = runner.head("lm_head")
    assert start == 0
    logits = (hidden[0, :-1] @ w.t()).float()
    return F.log_softmax(logits, -1).gather(-1, mb.input_ids[0, 1:, None]).squeeze(-1)


def _exercise(runner, batches) -> dict:
    """forward, forward_backward, optimizer_step, export: what the workers use."""
    fwd = runner.forward(batches, reduce=lambda h, k: _logp(runner, h, batches[k]))
    n_tok = sum(mb.input_ids.shape[1] - 1 for mb in batches)

    def loss_fn(h, k):
        loss = -_logp(runner, h, batches[k]).sum() / n_tok
        return loss, {"loss": float(loss.detach()), "k": k}

    opt = runner.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    metrics = runner.forward_backward(batches, loss_fn=loss_fn)
    export = runner.export_state_dict()
    export = {k: v.clone() for k, v in export.items()} if export is not None else None  # may alias the params
    norm = runner.optimizer_step(opt, max_norm=0.05)  # small: the clip acts on the gradients in place
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in runner.named_parameters()}
    params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in runner.named_parameters()}
    moved = any(not torch.equal(p, export[n]) for n, p in params.items()) if export is not None else None
    return {"fwd": fwd, "metrics": metrics, "grads": grads, "norm": norm, "export": export, "moved": moved,
            "has_last": runner.has_last, "exporter": runner.is_exporter}


def _critic() -> LlamaForValue:
    from models.llama import init_weights

    critic = LlamaForValue(build_model("tiny", seed=0).config)
    init_weights(critic, seed=5)  # every rank builds the same weights before the split
    return critic


PRESET = {"pp2": "tiny", "fsdp2": "tiny", "pp2-tied": "tiny-qwen3"}
TIED = ("lm_head.weight", "model.embed_tokens.weight")  # the last stage's copy, and the weight it copies


def _reference(preset: str = "tiny") -> dict:
    return _exercise(LocalRunner(build_model(preset, seed=0), attn_factory=DocumentAttention), _batches())


def _body(rank, world):
    from parallel.apply import parallelize_model
    from parallel.dims import ParallelDims, build_mesh

    out = {}
    for name, dims in (("pp2", ParallelDims(pp=2)), ("fsdp2", ParallelDims(dp=2)), ("pp2-tied", ParallelDims(pp=2))):
        mesh = build_mesh(dims, list(range(world)), device_type="cpu")
        runner = parallelize_model(build_model(PRESET[name], seed=0), mesh=mesh, dims=dims, n_microbatches=4,
                                   attn_factory=DocumentAttention)
        assert runner.microbatches == (4 if dims.pp > 1 else None)
        out[name] = _exercise(runner, _batches())
        # after the step: the tied weight's copy on this rank (embedding first, head last), to compare
        params = dict(runner.named_parameters())
        out[name]["tied_after_step"] = next((params[n].detach().clone() for n in TIED if n in params), None)
    # a value model's head on the last stage: values equal the single-process model's
    dims = ParallelDims(pp=2)
    runner = parallelize_model(_critic(), mesh=build_mesh(dims, list(range(world)), device_type="cpu"), dims=dims,
                               n_microbatches=4, attn_factory=DocumentAttention)
    out["values"] = runner.forward(_batches(), reduce=lambda h, k: F.linear(h.float(), runner.head("score")[0]))
    out["value_export"] = runner.export_state_dict()
    # a TP=2 value model: DTensor trunk grads beside the plain score head's, clipped in one step
    dims = ParallelDims(tp=2)
    runner = parallelize_model(_critic(), mesh=build_mesh(dims, list(range(world)), device_type="cpu"), dims=dims,
                               attn_factory=DocumentAttention)
    out["tp2_critic"] = _clipped_value_grads(runner)
    return out


def _clipped_value_grads(runner) -> tuple[float, dict]:
    """(grad norm, full clipped gradients by name) after one value-loss step clipped to a small norm."""
    batches = _batches()

    def loss_fn(h, k):
        return F.linear(h.float(), runner.head("score")[0]).square().mean(), {}

    opt = runner.build_optimizer(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    runner.forward_backward(batches, loss_fn=loss_fn)
    norm = runner.optimizer_step(opt, max_norm=1e-3)
    return norm, {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                  for n, p in runner.named_parameters()}


@pytest.mark.distributed
def test_runners_equal_the_single_process_runner():
    refs = {preset: _reference(preset) for preset in set(PRESET.values())}
    res = run_world(_body, 2)
    for name in ("pp2", "fsdp2", "pp2-tied"):
        ref = refs[PRESET[name]]
        if name == "pp2-tied":  # the last stage's head copy answers for the tied weight
            ref = {**ref, "grads": {**ref["grads"], TIED[0]: ref["grads"][TIED[1]]},
                   "export": {**ref["export"], TIED[0]: ref["export"][TIED[1]]}}
            first, last = (r[name]["tied_after_step"] for r in res)
            assert torch.equal(first, last)  # stepped with the same gradient and clip: still one weight
        last = [r[name] for r in res if r[name]["has_last"]]
        assert len(last) == (2 if name == "fsdp2" else 1), name
        for r in last:
            for got, want in zip(r["fwd"], ref["fwd"], strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
            assert [m["k"] for m in r["metrics"]] == [0, 1, 2, 3]
            torch.testing.assert_close([m["loss"] for m in r["metrics"]], [m["loss"] for m in ref["metrics"]])
        assert all(r[name]["fwd"] is None and r[name]["metrics"] == [] for r in res if not r[name]["has_last"])
        seen = set()
        for r in res:
            for n, g in r[name]["grads"].items():
                torch.testing.assert_close(g, ref["grads"][n], rtol=1e-4, atol=1e-6, msg=f"{name} {n}")
                seen.add(n)
            assert r[name]["norm"] == pytest.approx(ref["norm"], rel=1e-5)
        assert seen == set(ref["grads"])  # HF names, every parameter on some rank
        exports = [r[name]["export"] for r in res if r[name]["exporter"]]
        assert len(exports) == 1 and all(r[name]["export"] is None for r in res if not r[name]["exporter"])
        assert exports[0].keys() == ref["export"].keys()
        for n, t in exports[0].items():
            assert torch.equal(t, ref["export"][n]), f"{name} {n}"
        assert all(r[name]["moved"] for r in res if r[name]["exporter"] and r[name]["has_last"])
    # the value head runs on the last stage; the export carries trunk + score
    export = res[0]["value_export"]
    assert "score.weight" in export and "model.embed_tokens.weight" in export and "lm_head.weight" not in export
    critic = _critic()
    assert all(torch.equal(export[n], p) for n, p in critic.state_dict().items())
    with torch.no_grad():
        want = [critic(mb.input_ids, mb.position_ids, attn=DocumentAttention(mb.position_ids)) for mb in _batches()]
    for got, w in zip(res[1]["values"], want, strict=True):
        torch.testing.assert_close(got.squeeze(-1), w, rtol=1e-5, atol=1e-5)
    ref_norm, ref_grads = _clipped_value_grads(LocalRunner(_critic(), attn_factory=DocumentAttention))
    assert ref_norm > 1e-2  # the clip to 1e-3 acts
    for r in res:
        norm, grads = r["tp2_critic"]
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert grads.keys() == ref_grads.keys()
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-9, msg=n)
