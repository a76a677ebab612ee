"""torch.compile of megatron-core's TransformerLayers (parallel.backends.compile_megatron_layers) on CPU:
Dynamo traces megatron's layer with our core attention and RoPE, and forward and gradients equal eager.
(aot_eager here: Dynamo + AOTAutograd, the parts that can break on megatron's Python; inductor's kernels
are measured on the GPU by bench.train_step --backend megatron with a compile spec.)"""

import copy

import pytest
import torch

from tests.dist_utils import run_world

pytest.importorskip("megatron.core")


def _body(rank, world):
    from models.config import preset_config
    from models.document_attention import DocumentAttention
    from models.llama import LlamaForCausalLM, init_weights
    from models.megatron_model import megatron_hidden
    from parallel.backends import build_runner, compile_megatron_layers
    from parallel.dims import ParallelDims, build_mesh

    cfg = preset_config("tiny")
    native = LlamaForCausalLM(cfg)
    init_weights(native, seed=0)
    dims = ParallelDims(tp=1, pp=1, dp=1)
    mesh = build_mesh(dims, [0], device_type="cpu")
    eager = build_runner(copy.deepcopy(native), backend="megatron", mesh=mesh, dims=dims)
    compiled = build_runner(copy.deepcopy(native), backend="megatron", mesh=mesh, dims=dims, compile=True)
    wrapped = all(layer._compiled_call_impl is not None for layer in compiled.gpt.decoder.layers)
    compile_megatron_layers(compiled.gpt, backend="aot_eager")  # the same wrapping, a CPU-cheap backend

    ids = torch.randint(3, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(10), torch.arange(14)]).unsqueeze(0)  # two packed documents
    from torch._dynamo.utils import counters

    counters.clear()
    out = {}
    for name, runner in (("eager", eager), ("compiled", compiled)):
        gpt = runner.gpt
        hidden = megatron_hidden(gpt, ids, pos, attn=DocumentAttention(pos))
        loss = (hidden.float() @ gpt.output_layer.weight.float().t()).logsumexp(-1).mean()
        loss.backward()
        out[name] = (hidden.detach(), {n: p.grad.clone() for n, p in gpt.named_parameters()})
    (h0, g0), (h1, g1) = out["eager"], out["compiled"]
    graphs = counters["stats"]["unique_graphs"]  # Dynamo really traced megatron's layer (not all skipped)
    return dict(wrapped=wrapped, graphs=graphs, breaks=sum(counters["graph_break"].values()),
                hidden_err=(h0 - h1).abs().max().item(),
                grad_err=max((g0[n] - g1[n]).abs().max().item() for n in g0), same_names=set(g0) == set(g1))


def test_compiled_megatron_layers_equal_eager():
    res = run_world(_body, 1, timeout=300)[0]
    assert res["wrapped"] and res["same_names"] and res["graphs"] >= 1, res
    assert res["hidden_err"] < 1e-5 and res["grad_err"] < 1e-5, res
