"""Qwen3 (per-head q/k RMSNorm before RoPE) on the megatron-core backend, on CPU over gloo.

megatron-core's local spec with qk_layernorm runs torch RMSNorm([head_dim]) on q/k per head right after
its QKV split, before our core attention applies RoPE: HF Qwen3's order. One world of 2 checks, for
tiny-qwen3 (tied head) and a transformers Qwen3ForCausalLM (untied), at tp 1 and 2: logits equal the
native model's (and transformers'), log-prob / entropy gradients equal the native ones once megatron-core's
own TP reduction of the replicated q/k layernorm grads has run, and at tp 2 HF -> megatron -> HF export and
the reshard to generation shards are exact.
"""

import types

import pytest
import torch

from tests.dist_utils import run_world

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

TOL = 1e-5
HF_TOL = 1e-4  # our native Qwen3 vs transformers (tests/models/test_hf_parity.py's bound)


def _tiny_qwen3():
    from models.config import preset_config
    from models.llama import LlamaForCausalLM, init_weights

    model = LlamaForCausalLM(preset_config("tiny-qwen3"))
    init_weights(model, seed=0)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms away from 1, distinct per layer and for q vs k: a dropped norm shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.2, generator=gen)
    return model, None


def _transformers_qwen3():
    """(native model, transformers Qwen3ForCausalLM) with the same random weights (untied head)."""
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from tests.models.hf_fixtures import hf_causal_lm

    hf = hf_causal_lm("qwen3", seed=4)
    native = LlamaForCausalLM(ModelConfig.from_hf(hf.config.to_dict()))
    weights = hf.state_dict()
    with torch.no_grad():
        for n, p in native.named_parameters():
            p.copy_(weights[n])
    return native, hf


def _reduced_grads(gpt, pgc):
    """{megatron name: grad} after megatron-core's finalize step for TP-replicated weights (it sums
    q_layernorm / k_layernorm grads over TP when config.qk_layernorm; each rank saw only its heads).
    That function reads `ddp_config` off the model chunk: a forward-only build has none, so lend one."""
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    gpt.ddp_config = types.SimpleNamespace(use_megatron_fsdp=False)
    _allreduce_non_tensor_model_parallel_grads([gpt], gpt.config, pgc.tp)
    del gpt.ddp_config
    return {n: p.grad for n, p in gpt.named_parameters()}


def _grad_case(native, gpt, pgc, ids, pos):
    """Max |diff| of log-probs, entropies and every parameter's gradient (this rank's TP shard), megatron vs native."""
    from models.logprobs import compute_token_logprobs
    from models.megatron_map import megatron_to_hf
    from models.megatron_model import head_weight, megatron_hidden
    from parallel.sharding import tp_slices
    from parallel.vocab_parallel import vocab_parallel_token_logprobs

    cfg = native.config
    tp, r = pgc.tp.size(), pgc.tp.rank()
    gen = torch.Generator().manual_seed(3)  # the same draws on every TP rank
    targets = torch.randint(0, cfg.vocab_size, ids.shape, generator=gen)
    w_lp, w_ent = torch.rand(ids.numel(), generator=gen), torch.rand(ids.numel(), generator=gen)
    native.zero_grad(set_to_none=True)
    h = megatron_hidden(gpt, ids, pos).transpose(0, 1).reshape(-1, cfg.hidden_size)
    lp, ent = vocab_parallel_token_logprobs(h, head_weight(gpt), targets.reshape(-1), tp_group=pgc.tp,
                                            vocab_start=r * cfg.vocab_size // tp, with_entropy=True, chunk_size=5)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    nh = native.hidden_states(ids, pos).reshape(-1, cfg.hidden_size)
    nlp, nent = compute_token_logprobs(nh, native.lm_head.weight, targets.reshape(-1), with_entropy=True,
                                       chunk_size=5)
    ((nlp * w_lp).sum() + (nent * w_ent).sum()).backward()
    grads = megatron_to_hf(_reduced_grads(gpt, pgc), cfg, tp=tp, pp=1, pp_rank=0)
    ref = dict(native.named_parameters(remove_duplicate=False))
    gerr = {n: (g - ref[n].grad[tp_slices(n, tuple(ref[n].shape), rank=r, world=tp)]).abs().max().item()
            for n, g in grads.items()}
    qk = max(v for n, v in gerr.items() if n.endswith(("q_norm.weight", "k_norm.weight")))
    return max((lp - nlp).abs().max().item(), (ent - nent).abs().max().item(), max(gerr.values())), qk


def _body(rank, world):
    from megatron.core import parallel_state

    from parallel.runner import MicroBatch
    from tests.parallel.test_megatron import _export_case, _gather_vocab, _megatron, _reshard_case

    out = {}
    for name, build in (("tiny-qwen3", _tiny_qwen3), ("transformers", _transformers_qwen3)):
        native, hf = build()
        vocab = native.config.vocab_size
        ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(9).expand(2, 9)
        with torch.no_grad():
            ref = native(ids, pos)
            hf_ref = hf(ids).logits if hf is not None else None
        for tp in (1, 2):
            runner, gpt, pgc = _megatron(native, tp, world)
            attn, eps = gpt.decoder.layers[0].self_attention, native.config.rms_norm_eps
            out[(name, tp, "qk_layernorm")] = bool(
                gpt.config.qk_layernorm and isinstance(attn.q_layernorm, torch.nn.RMSNorm)
                and attn.k_layernorm.weight.shape == (native.config.head_dim,) and attn.q_layernorm.eps == eps)
            w, _ = runner.head("lm_head")
            rows = [MicroBatch(ids[i:i + 1], pos[i:i + 1]) for i in range(len(ids))]
            with torch.no_grad():
                logits = _gather_vocab(torch.cat(runner.forward(rows, reduce=lambda h, k, w=w: h @ w.t())), pgc)
            out[(name, tp, "logits")] = (logits - ref).abs().max().item()
            if hf_ref is not None:
                out[(name, tp, "hf_logits")] = (logits - hf_ref).abs().max().item()
            out[(name, tp, "grads")], out[(name, tp, "qk_norm_grads")] = _grad_case(native, gpt, pgc, ids, pos)
            if tp == 2:
                out[(name, tp, "reshard")] = _reshard_case(native, runner, pgc, world)
                out[(name, tp, "export")] = _export_case(native, runner, rank, exact_names=True)
    out["globals_untouched"] = not parallel_state.model_parallel_is_initialized()
    return out


@pytest.mark.distributed
def test_qwen3_megatron_matches_native_and_transformers_at_tp1_and_tp2():
    for res in run_world(_body, world_size=2, timeout=300):
        assert res.pop("globals_untouched")
        for key, val in res.items():
            if key[2] in ("qk_layernorm", "reshard", "export"):
                assert val is True, key
            else:
                assert val < (HF_TOL if key[2] == "hf_logits" else TOL), (key, val)
