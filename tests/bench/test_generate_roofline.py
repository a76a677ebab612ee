"""bench/generate.py's ceilings: the decode roofline's bytes and the prefill's FLOP floor, by hand."""

import torch

from bench.generate import decode_roofline, prefill_floor_s
from models import preset_config


def test_prefill_floor_counts_each_prompt_once_and_the_lm_head_per_row():
    cfg = preset_config("qwen3-0.6b")
    body, layers = cfg.matmul_params(lm_head=False), cfg.num_hidden_layers
    width = cfg.num_attention_heads * cfg.head_dim
    p = 128
    # per prompt token: 2 N_body + causal attention over (p + 1) / 2 keys on average, 4 L W per (query, key) pair
    per_prompt = p * 2 * body + 4 * layers * width * p * (p + 1) / 2
    head = 2 * cfg.vocab_size * cfg.hidden_size
    got = prefill_floor_s(cfg, batch=256, prompt_len=p, peak_flops=1e12)
    assert abs(got - (256 * per_prompt + 256 * head) / 1e12) < 1e-9 * got
    shared = prefill_floor_s(cfg, batch=256, prompt_len=p, peak_flops=1e12, samples_per_prompt=4)
    assert abs(shared - (64 * per_prompt + 256 * head) / 1e12) < 1e-9 * shared


def test_decode_roofline_reads_the_weights_every_step_and_the_growing_kv():
    cfg = preset_config("qwen3-0.6b")
    r = decode_roofline(cfg, batch=8, prompt_len=10, new_tokens=4, dtype=torch.bfloat16, all_weights=True)
    kv_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2  # K and V, bf16
    kv = sum(8 * (10 + s) for s in range(1, 4)) * kv_token
    assert abs(r["bytes_per_decode_step_gb"] * 3 * 1e9 - (3 * cfg.num_params() * 2 + kv)) < 1e3
