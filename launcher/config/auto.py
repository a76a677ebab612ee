"""Settings left unset (None) resolved at start-up from the device and the roles: fast where it is safe,
each choice with its reason, and an explicit setting always wins.

    choices = resolve_auto(cfg)     # after validation; -> ["actor.compile=true (auto: ...)", ...]

Resolved values go into the run directory's config.yaml, so a run records what it ran with; rank 0 logs
each choice as one line (launcher/main.py).
"""

from __future__ import annotations

from launcher.config.schema import MODEL_ROLES, Config, active_roles, kept_kv_sessions, role_section, section_name

# micro-batch token budgets off CUDA (on CUDA launcher.planning.fit sizes them from the GPU's memory): the trained
# roles keep activations for a backward, the forward-only ones pack twice as many tokens
CPU_MICRO_BATCH_TOKENS = {"actor": 4096, "critic": 4096, "ref": 8192, "reward": 8192}


def on_cuda(cfg: Config) -> bool:
    """Whether the run trains on CUDA: trainer.device=cuda, or auto with a GPU visible."""
    if cfg.trainer.device == "cuda":
        return True
    if cfg.trainer.device == "cpu":
        return False
    import torch

    return torch.cuda.is_available()


def resolve_auto(cfg: Config) -> list[str]:
    """Fill every unset speed setting of `cfg` in place. -> one line per choice: key=value (auto: why)."""
    cuda = on_cuda(cfg)
    choices = []

    used = set(active_roles(cfg))

    def choose(key: str, value, why: str) -> None:
        section, name = key.rsplit(".", 1)
        setattr(role_section(cfg, "reward") if section == "reward.model" else getattr(cfg, section), name, value)
        role = section.split(".")[0]
        if role not in MODEL_ROLES or role in used:  # an unused role: no line
            choices.append(f"{key}={str(value).lower()} (auto: {why})")

    for role in MODEL_ROLES:
        sec, name = role_section(cfg, role), section_name(role)
        if sec is None or sec.compile is not None:  # a rule reward has no model: nothing to choose
            continue
        if not cuda:
            choose(f"{name}.compile", False, "no CUDA device: torch.compile's CPU kernels are slower to build than "
                                             "they save on a tiny model")
        elif sec.backend == "megatron" and getattr(sec, "activation_checkpointing", None) == "full":
            choose(f"{name}.compile", False, "megatron's full recompute wraps the layers itself")
        else:
            choose(f"{name}.compile", True, "CUDA: each transformer layer compiled (fused norms, RoPE, SiLU)")
    for role in MODEL_ROLES:
        sec, name = role_section(cfg, role), section_name(role)
        if not cuda and sec is not None and sec.max_tokens_per_micro_batch is None:
            choose(f"{name}.max_tokens_per_micro_batch", CPU_MICRO_BATCH_TOKENS[role],
                   "no CUDA device: a CPU micro-batch gains nothing from more tokens")
    r = cfg.rollout
    if r.compile is None:
        if not cuda:
            choose("rollout.compile", False, "no CUDA device")
        elif r.engine != "native":
            choose("rollout.compile", False, f"rollout.engine={r.engine} compiles with its own settings")
        else:
            choose("rollout.compile", True, "CUDA: the native engine's decode forward compiled into its CUDA graphs")
    _resolve_engine_memory(cfg, cuda, choose, choices)
    if cfg.trainer.share_prompts is None:
        a, ref = cfg.actor, cfg.ref
        if cfg.rollout.n == 1:
            cfg.trainer.share_prompts = False  # nothing to share (no line: nothing to choose)
        elif a.pp > 1 or ref.pp > 1:
            choose("trainer.share_prompts", False, "pipeline micro-batches cannot pack a prompt with its responses")
        elif "megatron" in (a.backend, ref.backend):
            choose("trainer.share_prompts", False, "the megatron backend packs every sample apart")
        else:
            choose("trainer.share_prompts", True, f"rollout.n={cfg.rollout.n}: each prompt packed once with its "
                                                  f"responses in the actor and reference forwards")
    return choices


def _resolve_engine_memory(cfg: Config, cuda: bool, choose, choices: list[str]) -> None:
    """The engine's concurrency and KV-cache share. rollout.free_memory_on_sleep stays unset on CUDA with the
    native engine: ppo.roles.generation.RolloutRole.settle_memory decides it from the first step's measured peaks."""
    r = cfg.rollout
    if r.max_num_seqs is None:
        rows = cfg.data.batch_size * r.n
        choose("rollout.max_num_seqs", rows, f"the step's rows (data.batch_size {cfg.data.batch_size} x n {r.n}) "
                                             f"decode in one wave when the KV cache holds them")
    if r.max_parked_seqs is None:
        rows = cfg.data.batch_size * r.n * (r.batches_in_flight if r.partial_kv == "keep" else 1)
        if kept_kv_sessions(cfg) and rows > r.max_num_seqs:
            choose("rollout.max_parked_seqs", rows - r.max_num_seqs,
                   f"{rows} rows in flight keep their KV between turns beside rollout.max_num_seqs={r.max_num_seqs} "
                   f"decoding at once")
        else:
            r.max_parked_seqs = 0  # nothing parks beyond the decode slots (no line: nothing to choose)
    if r.free_memory_on_sleep is None and r.decode_beside and not cuda:
        choose("rollout.free_memory_on_sleep", False, "rollout.decode_beside decodes while the step trains")
    if r.free_memory_on_sleep is None and not (cuda and r.engine == "native"):
        why = "no CUDA device" if not cuda else f"rollout.engine={r.engine} sleeps with its own levels"
        choose("rollout.free_memory_on_sleep", True, why)
    if r.gpu_memory_fraction is None:
        if r.free_memory_on_sleep is False:
            choose("rollout.gpu_memory_fraction", 0.5, "the engine stays resident: training needs the other half")
        else:
            choose("rollout.gpu_memory_fraction", 0.9, "the KV cache is allocated while training's activations "
                                                       "are freed (rollout.max_num_seqs caps it)")
    if r.free_memory_on_sleep is None:
        choices.append("rollout.free_memory_on_sleep=auto (decided after the first step: the engine stays resident "
                       "when the training peak plus its memory fits in 90% of the GPU)")
