"""FLOP accounting for PPO/GRPO steps (docs/design.md, "FLOPs and MFU"): what `perf/useful_util` and
`perf/mfu/actor` count, and the peak they divide by. Pure functions; the launcher's monitor, the cost
model and the benchmarks use them too.

The convention is the field's (torchtitan, Megatron, the papers): MFU = model FLOPs / (time x GPUs x
the device's dense bf16 spec peak), 989 TFLOP/s on an H100/H200 SXM. A device missing from the table
gets no MFU rather than a guess. The H200's measured matmul ceiling (~790 TFLOP/s) is a second column
only (MEASURED_H200_MATMUL_FLOPS).
"""

from __future__ import annotations

# dense bf16 tensor-core peaks from the vendors' data sheets (no sparsity), by a substring of
# torch.cuda.get_device_name(); the first match wins, so more specific names come first
SPEC_PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),  # SXM and NVL report the same dense bf16 peak
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
)
MEASURED_H200_MATMUL_FLOPS = 790e12  # bench.env_check's measured bf16 matmul ceiling: a second column


def spec_peak_flops(device_name: str | None) -> float | None:
    """The device's dense bf16 spec peak in FLOP/s, or None for a device not in the table (CPU included)."""
    if not device_name:
        return None
    for key, peak in SPEC_PEAK_BF16_FLOPS:
        if key in device_name:
            return peak
    return None


def useful_utilization(flops: float, seconds: float, *, n_gpus: int, peak_flops: float) -> float:
    """Fraction of the devices' peak FLOP/s spent on useful model FLOPs (MFU-style)."""
    if seconds <= 0 or n_gpus <= 0 or peak_flops <= 0:
        raise ValueError(f"useful_utilization needs seconds, n_gpus and peak_flops > 0, got seconds={seconds}, "
                         f"n_gpus={n_gpus}, peak_flops={peak_flops}")
    return flops / (seconds * n_gpus * peak_flops)


def ppo_stage_flops(
    *,
    n_params_actor: int,
    n_params_critic: int | None,
    n_params_ref: int | None,
    n_params_rm: int | None,
    trained_tokens: int,
    generated_tokens: int,
    ppo_epochs: int,
    prefill_tokens: int = 0,
    old_logp_share: float = 1.0,
    policy_tokens: int | None = None,
    attention_policy: float = 0.0,
    attention_full: float = 0.0,
    adapter_params_actor: int = 0,
) -> dict[str, float]:
    """Model FLOPs of one PPO step per stage (keys match the timing_s/<stage> names).

    The dense-transformer rule of docs/design.md: a forward costs 2N FLOP per token, forward+backward
    6N, N the matmul parameters (an LM head included for the policy, none for a critic or reward model:
    their N comes from ModelConfig.matmul_params(lm_head=False)). `trained_tokens` is prompt+response
    tokens of the batch as fed to the trainer; `generated_tokens` the decoded tokens and `prefill_tokens`
    the prompt tokens the engine prefilled (2N each; counted under "gen"). Attention's q.k and p.v come on top,
    causal (`attention_forward_flops`): `attention_policy` is one forward's over the tokens the policy forwards
    pack (prompts once per group with shared prompts; the engine attends the same pairs), `attention_full` over
    whole sequences (the critic's packs); x3 with a backward. Defaults 0: matmuls only.
    A None model is absent (GRPO: no critic; kl_coef 0: no ref; rule reward: no RM).
    old_logp_share: the share of the batch a separate old-log-prob forward ran over (ppo.roles.step_plan:
    0 where async rollout takes the behaviour log-probs of generation or one epoch over one mini-batch reuses
    the update's forward, GRPO with a reference then being the 8N per trained token of 6N update + 2N
    reference; (M - 1) / M where the first of M mini-batches reuses its forward).
    policy_tokens: the tokens the actor and reference forwards really process when that is fewer than
    trained_tokens (trainer.share_prompts packs a prompt once per group), so useful FLOPs never count
    work that was not needed.
    adapter_params_actor: a LoRA actor's adapter parameters A (0: full-parameter training). Its frozen base gets
    no weight gradients: the update counts the forward and the input gradients over base and adapters, 4(N + A),
    and weight gradients for the adapters only, 2A (4N + 6A per token instead of 6N).
    """
    t = float(trained_tokens)
    tp = t if policy_tokens is None else float(policy_tokens)
    ap, af = attention_policy, attention_full
    out = {
        "gen": 2.0 * n_params_actor * (generated_tokens + prefill_tokens) + ap,
        "old_log_prob": (2.0 * n_params_actor * tp + ap) * old_logp_share,
        "ref": 2.0 * n_params_ref * tp + ap if n_params_ref else 0.0,
        "reward": 2.0 * n_params_rm * t if n_params_rm else 0.0,  # its shape may differ: matmuls only
        "values": 2.0 * n_params_critic * t + af if n_params_critic else 0.0,
        "update_actor": (update_matmul_flops(n_params_actor, adapter_params_actor) * tp + 3.0 * ap) * ppo_epochs,
        "update_critic": (6.0 * n_params_critic * t + 3.0 * af) * ppo_epochs if n_params_critic else 0.0,
    }
    return out


def update_matmul_flops(n_matmul: int, adapter_params: int = 0) -> float:
    """Matmul FLOPs of one trained token's forward and backward: 6N, or with LoRA adapters (A parameters, the
    base frozen) 4(N + A) for the forward and input gradients plus 2A for the adapters' weight gradients."""
    a = float(adapter_params)
    return 4.0 * (n_matmul + a) + 2.0 * (a if adapter_params else n_matmul)


def ppo_step_flops(**kwargs) -> float:
    """Total model FLOPs of one PPO step: the sum of `ppo_stage_flops(**kwargs)` (about 20N per
    trained token for full PPO with one epoch, plus 2N per generated or prefilled token)."""
    return sum(ppo_stage_flops(**kwargs).values())


def attention_context(lengths: list[int], *, causal: bool = True) -> float:
    """The mean number of key positions a token attends to over documents of these lengths: (T + 1) / 2
    for a document of T tokens under a causal mask, T without one. The attention term of
    `flops_per_token` takes it as `context` (the convention here is causal, as the models are)."""
    total = sum(lengths)
    if total <= 0:
        raise ValueError(f"attention_context needs at least one token, got lengths {lengths}")
    per_doc = (lambda t: t * (t + 1) / 2) if causal else (lambda t: t * t)
    return sum(per_doc(t) for t in lengths) / total


def attention_forward_flops(prompt_lengths: list[int], response_lengths: list[list[int]], *, layers: int,
                            attn_width: int, share_prompts: bool) -> float:
    """Causal q.k and p.v FLOPs of one forward over groups of samples (a prompt and its responses), 4 L W per
    attended (query, key) pair, W = heads x head_dim. With shared prompts a prompt's own pairs count once per
    group (it is packed once); each response attends its prompt and its own earlier tokens either way."""
    pairs = 0
    for p, rs in zip(prompt_lengths, response_lengths, strict=True):
        prompt_pairs = p * (p + 1) // 2
        pairs += prompt_pairs * (1 if share_prompts else len(rs)) + sum(r * p + r * (r + 1) // 2 for r in rs)
    return 4.0 * layers * attn_width * pairs


def flops_per_token(n_matmul: int, *, layers: int, attn_width: int, context: float, train: bool) -> float:
    """Model FLOPs of one token: 2N forward (6N with backward) for the matmuls, plus attention's q.k and
    p.v, 4 L W C forward (12 L W C with backward), W = heads x head_dim, C = attention_context(...)."""
    mult = 3 if train else 1
    return mult * (2 * n_matmul + 4 * layers * attn_width * context)
