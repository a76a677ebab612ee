"""Build the roles this rank hosts (actor, rollout, ref, critic, reward) from the device plan,
and the loss functions the updates use. The trainer composes these objects (docs/design.md, convention 6)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from models.config import ModelConfig
from models.heads import LlamaForSequenceClassification, LlamaForValue
from models.llama import LlamaForCausalLM, init_weights
from ppo.algos import core_algos as algos
from ppo.algos.policy_losses import compute_policy_loss
from ppo.batch.experience import Experience, Sample
from ppo.batch.step_batch import StepBatch
from ppo.data.rewards import RewardSample
from ppo.roles.actor_critic import CriticWorker, PolicyWorker, score_heads
from ppo.roles.generation import RolloutRole, build_rollout_groups, idle_vllm_engine
from ppo.roles.placement import Placement
from ppo.roles.workers import ShardedWorker, WorkerSpec, export_hf, model_dtype, to_host
from ppo.settings import LoRASettings, PPOSettings, RolesSettings, WorkerLayout


def _build(cls, model_config: ModelConfig, *, path: str | None, device, seed: int):
    """Weights from a local HF directory, or a seeded random init identical on every rank."""
    if path:
        from models.hf_io import load_pretrained

        return load_pretrained(path, dtype=torch.float32, device=device, model_cls=cls)
    with torch.device(device):
        model = cls(model_config)
    init_weights(model, seed=seed)  # trunk draws come first, so actor/ref/critic trunks start equal
    if isinstance(model, LlamaForValue):
        with torch.no_grad():
            model.score.weight.zero_()  # a zero value head: the critic starts unbiased
    return model


def _spec(layout: WorkerLayout, handle, placement: Placement, dtype, *, share_prompts: bool = False,
          frozen: bool = False, stream_optimizer_from_host: bool = False, router_replay: bool = False) -> WorkerSpec:
    return WorkerSpec(mesh=handle.mesh, dims=handle.dims, expert_mesh=handle.expert_mesh, device=placement.device,
                      dtype=dtype, frozen=frozen,
                      router_replay=router_replay,
                      fsdp_masters=stream_optimizer_from_host and layout.backend == "native",
                      backend=layout.backend, ac=layout.activation_checkpointing, compile=layout.compile,
                      pp_microbatches=layout.pp_microbatches, pp_schedule=layout.pp_schedule,
                      stages_per_rank=layout.pp_stages_per_rank, share_prompts=share_prompts)


class RuleReward:
    """Rule-based scores on the reward ranks, each over its DP share of the samples."""

    def __init__(self, manager, *, tokenizer, rank_in_group: int, group_size: int):
        self.manager, self.tokenizer = manager, tokenizer
        self.rank_in_group, self.group_size = rank_in_group, group_size

    def score(self, exp: Experience) -> dict[str, dict[int, torch.Tensor]]:
        """{"score": {uid: score}, "reward_failed": {uid: 1.0 if the function failed else 0.0}} plus
        {"reward/<key>": {uid: value}} for each numeric extra key a dict result carried (a sample without
        that key contributes nothing to its mean)."""
        mine = exp.samples[self.rank_in_group::self.group_size]
        prompts: dict[int, str] = {}  # a group's samples share one prompt list: decoded once
        for s in mine:
            if id(s.prompt_ids) not in prompts:
                prompts[id(s.prompt_ids)] = self.tokenizer.decode(s.prompt_ids)
        items = [RewardSample(s.uid, prompts[id(s.prompt_ids)], self._text(s), s.ground_truth,
                              {**(s.info or {}), "response_length": len(s.response_ids)}) for s in mine]
        res = self.manager.score(items)
        out = {"score": {s.uid: torch.tensor(float(v)) for s, v in zip(mine, res.scores)},
               "reward_failed": {s.uid: torch.tensor(float(s.uid in res.failures)) for s in mine}}
        for s, extra in zip(mine, res.extras):
            for k, v in extra.items():
                out.setdefault(f"reward/{k}", {})[s.uid] = torch.tensor(v)
        return out

    def close(self) -> None:
        """The reward worker process and what the function forked go (ppo.data.reward_worker)."""
        self.manager.close()

    def _text(self, s: Sample) -> str:
        if s.text is not None:  # an agent loop's final text (e.g. the last turn's answer)
            return s.text
        ids = s.response_ids
        eos = self.tokenizer.eos_token_id
        if ids and eos is not None and ids[-1] == eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


class RewardModelWorker(ShardedWorker):
    """A reward model (*ForSequenceClassification): the score at each sequence's last token."""

    def __init__(self, model, spec: WorkerSpec, *, pad_id: int, max_tokens: int):
        super().__init__(model, spec)
        self.pad_id, self.max_tokens = pad_id, max_tokens

    @torch.no_grad()
    def score(self, exp: Experience) -> dict[str, dict[int, torch.Tensor]]:
        """{"score": {uid: score}} (a model has no failures to count)."""
        def last_scores(packed, hidden):
            last = packed.cu_seqlens[1:].long() - 1  # each sequence's last token
            return score_heads(self.runner, hidden[0, last])[:, 0]

        outputs = self.reported(self._enqueue_forwards(
            exp, self.plan(exp, mini_batch_size=0, max_tokens=self.max_tokens), self.pad_id, last_scores))
        out: dict[int, torch.Tensor] = {}
        for (mb, _), scores in zip(outputs, to_host([s for _, s in outputs]) if outputs else []):
            for i, v in zip(mb, scores):
                out[exp.samples[i].uid] = v
        return {"score": out}


@dataclass
class Roles:
    settings: RolesSettings
    model_config: ModelConfig | None = None
    actor: PolicyWorker | None = None
    ref: PolicyWorker | None = None
    critic: CriticWorker | None = None
    reward: object | None = None
    rollout: object | None = None
    base_model_path: str | None = None  # model.path: a LoRA actor's adapter directory names it as its base
    idle_engine: object | None = None  # rollout.engine=vllm on a rank without the rollout role (never generates)

    @property
    def ref_is_actor_base(self) -> bool:
        """The reference is a LoRA actor's base with its adapters off (parallel.lora.AdaptersOffRunner)."""
        return self.ref is not None and self.actor is not None and self.ref.runner.modules is self.actor.runner.modules

    # -- plans: the same partition for the old-log-prob recompute and the update
    def actor_plan(self, exp, max_tokens: int):
        return self.actor.plan(exp, mini_batch_size=self.settings.actor_update.mini_batch_size, max_tokens=max_tokens)

    def ref_plan(self, exp, max_tokens: int):
        return self.ref.plan(exp, mini_batch_size=0, max_tokens=max_tokens)

    def critic_plan(self, exp, max_tokens: int):
        return self.critic.plan(exp, mini_batch_size=self.settings.critic_update.mini_batch_size,
                                max_tokens=max_tokens)

    # -- updates
    def rollout_token_budget(self) -> int:
        """The generation engine's prefill token budget (what the batch controller scales)."""
        if self.rollout is not None:
            return self.rollout.engine.config.max_num_batched_tokens
        from rollout.base import RolloutConfig

        return RolloutConfig().max_num_batched_tokens

    def update_actor(self, exp: Experience, batch: StepBatch, *, max_tokens: int,
                     old_logp: str = "recompute") -> dict[str, float]:
        """old_logp: the step's old-log-prob source (ppo.roles.step_plan.old_logp_source). "fused": the old
        log-probs are this forward's, detached (ratio == 1); "fused_first": so in the first mini-batch, before
        any optimizer step, and batch.old_logp's rows (recomputed before the update) after it; otherwise
        batch.old_logp's rows throughout. batch.ref_logp may be DeviceRows: the reference's log-probs, computed
        on these ranks and read on the device, never sent through the host."""
        settings, actor = self.settings.policy_loss, self.actor
        plan = self.actor_plan(exp, max_tokens)
        if old_logp == "fused" and len(plan) > 1:
            raise RuntimeError(f"fused old log-probs with {len(plan)} mini-batches: the step needs 'fused_first'")

        def fused() -> bool:  # the policy still the one that sampled: the forward is the old log-probs'
            return old_logp == "fused" or (old_logp == "fused_first" and actor.optimizer_steps_in_update == 0)

        def loss_fn(logp, entropy, t: StepBatch, denom):
            return compute_policy_loss(logp, old_logp=logp.detach() if fused() else t.old_logp,
                                       advantages=t.advantages, mask=t.mask, settings=settings,
                                       entropy=entropy, ref_logp=t.ref_logp, rollout_logp=t.rollout_logp,
                                       denom=denom, sync_metrics=False)  # the update converts them after its loop

        # only what the loss reads goes to the device; DAPO's overlong filter: truncated responses carry no policy
        # gradient (nor count in the denominator); the engine's log-probs for the rollout correction
        mine = StepBatch(mask=batch.mask if batch.actor_mask is None else batch.actor_mask,
                         advantages=batch.advantages, old_logp=None if old_logp == "fused" else batch.old_logp,
                         ref_logp=batch.ref_logp if settings.needs_ref else None, rollout_logp=batch.rollout_logp)
        # fused: no scoring forward measured the entropy, so the update reports it
        return actor.update(exp, plan, mine, epochs=self.settings.actor_update.epochs, loss_fn=loss_fn,
                            with_entropy=settings.needs_entropy or old_logp.startswith("fused"), agg=settings.agg)

    def update_critic(self, exp: Experience, batch: StepBatch, *, max_tokens: int) -> dict[str, float]:
        v = self.settings.value_loss

        def loss_fn(values, t: StepBatch, denom):
            loss, m = algos.value_loss(values, t.values, t.returns, t.mask, clip=v.clip, agg=v.agg,
                                       denom=denom, sync_metrics=False)
            m["vf_loss"] = loss.detach()  # converted after the update's micro-batch loop
            return loss, m

        return self.critic.update(exp, self.critic_plan(exp, max_tokens),
                                  StepBatch(mask=batch.mask, values=batch.values, returns=batch.returns),
                                  epochs=self.settings.critic_update.epochs, loss_fn=loss_fn,
                                  agg=self.settings.value_loss.agg)

    # -- supervised warm-up (the demo's "short SFT first", as real pipelines do)
    def sft_warmup(self, state, *, steps: int, max_tokens: int, run_dir) -> None:
        """Train the actor on the task's answers (micro-batches of max_tokens tokens), then make the warmed-up
        policy the reference and the critic's trunk (RL starts from the SFT model, and the KL is measured
        against it)."""
        if self.actor is not None:
            self._sft_actor(state, steps=steps, max_tokens=max_tokens)
            if self.actor.runner.lora_modules:
                # LoRA: the warmed-up policy becomes the base (the reference is the base with adapters off), and RL
                # starts fresh adapters (B = 0) with fresh moments
                from parallel.lora import merge_into_base

                merge_into_base(self.actor.runner)
                self.actor.optimizer.state.clear()
        self.load_reference(self._export_actor(run_dir), critic_trunk=True)

    def load_reference(self, path, *, critic_trunk: bool) -> None:
        """Reference (and optionally the critic's trunk) from an HF directory, e.g. the SFT warm-up's;
        on resume only the reference is reloaded (the critic comes back from the checkpoint)."""
        if self.ref is not None and not self.ref_is_actor_base:  # a LoRA actor's base is its reference already
            self.ref.runner.load_hf_weights(path, strict=False)
        if self.critic is not None and critic_trunk:  # trunk only: the value head keeps its init
            self.critic.runner.load_hf_weights(path, strict=False)

    def _sft_actor(self, state, *, steps: int, max_tokens: int) -> None:
        log = logging.getLogger("hybridrl")
        opt = self.actor.optimizer
        saved = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = self.settings.sft_lr

        def nll(logp, entropy, t: StepBatch, denom):
            loss = -(logp * t.mask).sum() / denom
            return loss, {"sft_loss": float(loss.detach())}

        for i in range(steps):
            pairs = state.sft_batch(i)
            # the tool loop's demonstrations where the run trains one (tool responses masked), else the pairs
            examples = self.rollout.demonstrations(pairs) if self.rollout is not None else [(*x, None) for x in pairs]
            exp = Experience([Sample(uid=j, prompt_index=j, prompt_ids=p, response_ids=r, behaviour_logprobs=[],
                                     finish_reason="stop", loss_mask=m) for j, (p, r, m) in enumerate(examples)])
            m = self.actor.update(exp, self.actor_plan(exp, max_tokens),
                                  StepBatch(mask=exp.response_mask()), epochs=1, loss_fn=nll, with_entropy=False,
                                  step_scheduler=False)
            if self.actor.is_owner and self.actor.dp_idx == 0 and (i % 20 == 0 or i == steps - 1):
                log.info("sft warm-up %d/%d: loss %.4f", i + 1, steps, m.get("sft_loss", float("nan")))
        for g, lr in zip(opt.param_groups, saved):
            g["lr"] = lr

    def _export_actor(self, run_dir):
        """The actor's full weights as an HF directory `<run_dir>/sft_warmup` (collective on the world)."""
        import torch.distributed as dist

        path = run_dir / "sft_warmup"
        if self.actor is not None:
            export_hf(self.actor, path, architecture="ForCausalLM")
        dist.barrier()
        return path


def _lora(lora: LoRASettings, *, seed: int):
    """(models.lora.LoRASpec, its initialisation seed, the init_from adapter's tensors or None)."""
    from models.lora import LoRASpec, read_peft_adapter

    spec = LoRASpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules)
    return spec, seed, read_peft_adapter(lora.init_from)[1] if lora.init_from else None


def _adapters_off_reference(actor: PolicyWorker | None, placement: Placement, *, temperature: float,
                            pad_id: int) -> PolicyWorker:
    """A LoRA actor's reference: the actor's own runner with its adapters off (no second model). The plan must
    put it on the actor's ranks in the actor's layout (launcher.config.validation._validate_lora)."""
    from parallel.lora import AdaptersOffRunner

    groups = placement.plan.groups
    if actor is None or groups["ref"].ranks != groups["actor"].ranks:
        raise RuntimeError(f"actor.lora: the reference is the actor's base, but the plan puts it on ranks "
                           f"{groups['ref'].ranks} and the actor on {groups['actor'].ranks}")
    return PolicyWorker(None, actor.spec, temperature=temperature, pad_id=pad_id, trainable=False,
                        runner=AdaptersOffRunner(actor.runner))


def build_roles(settings: PPOSettings, placement: Placement, *, model_config: ModelConfig, tokenizer,
                total_steps: int) -> Roles:
    """Construct the workers of every role this rank hosts. settings.build gives the models' sources,
    layouts and optimizers, settings.reward the reward role, settings.run the seed; the updates, losses and
    generation read settings.roles and settings.generation. total_steps: the run's steps (the learning-rate
    schedules' length)."""
    from ppo.data.reward_worker import build_reward_manager

    b, plan, groups = settings.build, placement.plan, placement.groups
    roles = Roles(settings.roles, model_config=model_config, base_model_path=b.model_path)
    rank, seed, device = placement.rank, settings.run.seed, placement.device
    dtype = model_dtype(b.dtype)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    temperature = settings.generation.temperature
    here = set(plan.roles_of(rank))
    if "actor" in here:
        model = _build(LlamaForCausalLM, model_config, path=b.model_path, device=device, seed=seed)
        if b.router_aux_loss_coef is not None:  # actor.router_aux_loss_coef over config.json's (exports carry it)
            model.config = model.model.config = replace(model.config, router_aux_loss_coef=b.router_aux_loss_coef)
        spec = _spec(b.layouts["actor"], groups["actor"], placement, dtype, share_prompts=b.share_prompts,
                     stream_optimizer_from_host=b.actor_optim.stream_from_host, router_replay=b.router_replay)
        if b.actor_lora is not None:
            spec.lora, spec.lora_seed, spec.lora_init = _lora(b.actor_lora, seed=seed)
        roles.actor = PolicyWorker(model, spec, temperature=temperature, pad_id=pad_id, trainable=True,
                                   optim=b.actor_optim, total_steps=total_steps)
    if "ref" in here and b.actor_lora is not None:
        roles.ref = _adapters_off_reference(roles.actor, placement, temperature=temperature, pad_id=pad_id)
    elif "ref" in here:
        model = _build(LlamaForCausalLM, model_config, path=b.model_path, device=device, seed=seed)
        spec = _spec(b.layouts["ref"], groups["ref"], placement, dtype, share_prompts=b.share_prompts, frozen=True,
                     router_replay=b.router_replay)
        roles.ref = PolicyWorker(model, spec, temperature=temperature, pad_id=pad_id, trainable=False)
    if "critic" in here:
        model = _build(LlamaForValue, model_config, path=b.critic_path or b.model_path, device=device, seed=seed)
        spec = _spec(b.layouts["critic"], groups["critic"], placement, dtype,
                     stream_optimizer_from_host=b.critic_optim.stream_from_host)
        roles.critic = CriticWorker(model, spec, pad_id=pad_id, optim=b.critic_optim, total_steps=total_steps)
    if "reward" in here:
        w = settings.reward
        if w.is_model:
            model = _build(LlamaForSequenceClassification, model_config, path=w.model_path, device=device,
                           seed=seed + 1)
            spec = _spec(b.layouts["reward"], groups["reward"], placement, dtype, frozen=True)
            roles.reward = RewardModelWorker(model, spec, pad_id=pad_id, max_tokens=w.max_tokens_per_micro_batch)
        else:
            manager = build_reward_manager(w.function, default_score=w.default_score, timeout_s=w.timeout_s,
                                           signature=w.signature, logger=logging.getLogger("hybridrl"))
            ranks = plan.groups["reward"].ranks
            roles.reward = RuleReward(manager, tokenizer=tokenizer, rank_in_group=ranks.index(rank),
                                      group_size=len(ranks))
    layouts = build_rollout_groups(plan)  # collective: every rank builds the hybrid engine's groups
    if "rollout" in here:
        roles.rollout = RolloutRole(settings.generation, plan=plan, actor=roles.actor, env=placement.env,
                                    model_config=model_config, tokenizer=tokenizer, layouts=layouts)
    elif settings.generation.engine_kind == "vllm":  # vLLM's start-up is collective over the whole world
        roles.idle_engine = idle_vllm_engine(settings.generation, plan=plan, env=placement.env,
                                             model_config=model_config)
    return roles
