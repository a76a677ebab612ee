"""Our Llama / Qwen2 / Qwen3 / Mistral logits equal transformers' on the same random weights (fp32)."""

import json

import pytest
import torch

from models import (
    DocumentAttention,
    LlamaForCausalLM,
    compute_token_logprobs,
    load_pretrained,
    read_config,
    save_pretrained,
)
from tests.models.hf_fixtures import hf_causal_lm, random_ids, save_hf

transformers = pytest.importorskip("transformers")
KINDS = ["llama", "llama3", "qwen2", "mistral", "qwen3", "qwen3-tied"]


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """kind -> (HF model, its saved directory), built on first use."""
    cache = {}

    def get(kind):
        if kind not in cache:
            model = hf_causal_lm(kind, seed=KINDS.index(kind))
            cache[kind] = (model, save_hf(model, tmp_path_factory.mktemp(kind)))
        return cache[kind]

    return get


@pytest.fixture(params=KINDS)
def hf_dir(request, hf_models):
    return (request.param, *hf_models(request.param))


def test_logits_equal_transformers(hf_dir):
    kind, hf, path = hf_dir
    ours = load_pretrained(path)
    ids = random_ids(2, 48, seed=1)  # 48 > original_max_position_embeddings(16): llama3 scaling matters
    with torch.no_grad():
        ref = hf(ids).logits
        out = ours(ids)
    assert out.shape == ref.shape == (2, 48, 128)
    assert (out - ref).abs().max().item() <= 1e-4
    if kind in ("qwen2", "qwen3-tied"):
        assert ours.lm_head.weight is ours.model.embed_tokens.weight
    if kind == "qwen2":
        assert ours.model.layers["0"].self_attn.q_proj.bias.abs().sum() > 0
    if kind.startswith("qwen3"):
        attn = ours.model.layers["0"].self_attn
        assert ours.config.head_dim * ours.config.num_attention_heads != ours.config.hidden_size
        assert attn.q_norm.weight.shape == (32,) and (attn.k_norm.weight - 1).abs().sum() > 0  # loaded, not init
        assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (kind == "qwen3-tied")


def test_llama3_rope_scaling_is_used(hf_models):
    _, path = hf_models("llama3")
    cfg = read_config(path)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 500.0
    ours, plain = load_pretrained(path), load_pretrained(path)
    plain.model.inv_freq = torch.tensor(1.0) / (500.0 ** (torch.arange(0, 16, 2).float() / 16))
    ids = random_ids(1, 48, seed=2)
    with torch.no_grad():
        assert (ours(ids) - plain(ids)).abs().max() > 1e-3  # the scaled frequencies change the answer


def test_our_save_loads_in_transformers(hf_dir, tmp_path):
    kind, hf, path = hf_dir
    ours = load_pretrained(path)
    out_dir = save_pretrained(ours, tmp_path / "ours")
    with open(out_dir / "config.json") as f:
        arch = json.load(f)["architectures"]
    assert arch == [type(hf).__name__]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), attn_implementation="eager",
                                                            dtype=torch.float32).eval()
    assert type(back) is type(hf)
    ids = random_ids(2, 20, seed=3)
    with torch.no_grad():
        assert (back(ids).logits - ours(ids)).abs().max().item() <= 1e-4


def test_packed_rows_equal_one_by_one(hf_models):
    hf, path = hf_models("qwen2")  # one family suffices: the mask logic is family-independent
    ours = load_pretrained(path)
    lengths = [5, 11, 7]
    seqs = [random_ids(1, n, seed=10 + i) for i, n in enumerate(lengths)]
    packed = torch.cat(seqs, dim=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        out = ours(packed, pos, attn=DocumentAttention(pos))
        ref = torch.cat([ours(s) for s in seqs], dim=1)
        ref_hf = torch.cat([hf(s).logits for s in seqs], dim=1)
    assert (out - ref).abs().max().item() <= 1e-5
    assert (out - ref_hf).abs().max().item() <= 1e-4


def test_trainer_logprobs_equal_transformers(hf_dir):
    """The PPO path (hidden states -> chunked log-probs) against log_softmax of HF's logits."""
    _, hf, path = hf_dir
    ours = load_pretrained(path)
    ids = random_ids(2, 30, seed=6)
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        got, _ = compute_token_logprobs(ours.hidden_states(ids)[:, :-1], ours.lm_head.weight, ids[:, 1:],
                                        chunk_size=7)
    assert got.shape == (2, 29) and (got - ref).abs().max().item() <= 1e-4


def test_hidden_states_then_lm_head_equal_forward(hf_models):
    _, path = hf_models("llama")
    ours: LlamaForCausalLM = load_pretrained(path)
    ids = random_ids(2, 9, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(ours.lm_head(ours.hidden_states(ids)), ours(ids), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama3", "qwen2", "qwen3"])
def test_bfloat16_cuda_close_to_transformers(hf_models, kind):
    _, path = hf_models(kind)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    hf = hf.cuda().eval()
    ours = load_pretrained(path, dtype=torch.bfloat16, device="cuda")
    assert ours.model.inv_freq.dtype == torch.float32  # RoPE frequencies are never rounded to bf16
    ids = random_ids(2, 200, seed=5).cuda()  # long enough that bf16 RoPE frequencies would show
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids).logits.float(), -1)
        out = torch.log_softmax(ours(ids).float(), -1)
    assert (out - ref).norm() <= 2e-2 * ref.norm()
