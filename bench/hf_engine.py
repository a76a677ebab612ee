"""`HFEngine`: the RolloutEngine protocol around Hugging Face `generate`, the baseline of bench/generate.py.

    engine = HFEngine.from_model(model, cache_implementation="static")   # or "dynamic"
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=64))

Requests with identical sampling params run as one left-padded `generate` call. Approximations
(why the native engine exists): a seed seeds the whole group's call, not each request, so outputs
depend on the batch around them; no continuous batching; tp=1 only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from rollout.base import Completion, SamplingParams, check_request, error_completions, expand_sampling


def build_hf_model(cfg: ModelConfig, *, device, dtype):
    """Uninitialised transformers causal LM of `cfg` (weights are loaded by name afterwards)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = cfg.to_hf()
    hf_cfg = AutoConfig.for_model(hf.pop("model_type"), **hf)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    return model.eval().requires_grad_(False)


class HFEngine:
    def __init__(self, model_config: ModelConfig, *, device="cpu", dtype=torch.float32,
                 cache_implementation: str = "dynamic", eos_token_ids: list[int] | None = None,
                 max_model_len: int | None = None):
        if cache_implementation not in ("dynamic", "static"):
            raise ValueError(f"cache_implementation={cache_implementation!r}; choose 'dynamic' or 'static'")
        self.model_config, self.device, self.dtype = model_config, torch.device(device), dtype
        self.cache_implementation = cache_implementation
        self.eos_token_ids = list(model_config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.max_model_len = max_model_len or model_config.max_position_embeddings
        self.pad_id = model_config.pad_token_id if model_config.pad_token_id is not None else 0
        self.model = build_hf_model(model_config, device=self.device, dtype=dtype)

    @classmethod
    def from_model(cls, model: LlamaForCausalLM, **kw) -> HFEngine:
        first = next(model.parameters())
        kw.setdefault("device", first.device)
        kw.setdefault("dtype", first.dtype)
        engine = cls(model.config, **kw)
        engine.update_weights(model.state_dict().items())
        return engine

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, t in named_tensors:
                if name not in params:
                    raise KeyError(f"HF model has no parameter {name!r}")
                params[name].copy_(t)

    def sleep(self) -> None:
        self.model.to("cpu")  # HF generate keeps no state between calls; the weights are the only memory
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self) -> None:
        self.model.to(self.device)

    def generate(self, prompts: list[list[int]],
                 sampling: SamplingParams | list[SamplingParams]) -> list[Completion]:
        params = expand_sampling(sampling, len(prompts))
        results: dict[int, list[Completion]] = {}
        groups: dict[tuple, list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            err = check_request(list(prompt), p, max_model_len=self.max_model_len,
                                vocab_size=self.model_config.vocab_size)
            if err is not None:
                results[i] = error_completions(i, list(prompt), p, err)
                continue
            key = (p.temperature, p.top_k, p.top_p, p.max_tokens, p.n, p.seed, tuple(p.stop_token_ids), p.ignore_eos)
            groups.setdefault(key, []).append(i)
        for idx in groups.values():
            for i, comps in zip(idx, self._generate_group([list(prompts[i]) for i in idx], params[idx[0]])):
                for c in comps:
                    c.prompt_index = i
                results[i] = comps
        return [c for i in range(len(prompts)) for c in results[i]]

    @torch.inference_mode()
    def _generate_group(self, prompts: list[list[int]], p: SamplingParams) -> list[list[Completion]]:
        from transformers import GenerationConfig

        width = max(len(q) for q in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, q in enumerate(prompts):  # left padding: every row's last prompt token is at the same column
            ids[r, width - len(q):] = torch.tensor(q)
            mask[r, width - len(q):] = 1
        stops = ([] if p.ignore_eos else self.eos_token_ids) + list(p.stop_token_ids)
        greedy = p.temperature == 0
        gen = GenerationConfig(do_sample=not greedy, temperature=None if greedy else p.temperature,
                               top_k=None if greedy or p.top_k <= 0 else p.top_k,
                               top_p=None if greedy or p.top_p >= 1 else p.top_p,
                               max_new_tokens=min(p.max_tokens, self.max_model_len - width),
                               num_return_sequences=p.n, eos_token_id=stops or None, pad_token_id=self.pad_id,
                               output_logits=True, return_dict_in_generate=True,
                               cache_implementation=self.cache_implementation)
        if p.seed is not None:
            torch.manual_seed(p.seed)
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                  generation_config=gen)
        new = out.sequences[:, width:]
        t = 1.0 if greedy else p.temperature
        # per step ([B * n, V] each): stacking all steps first would double the memory of the logits
        lps = torch.stack([torch.log_softmax(lg.float() / t, dim=-1).gather(1, new[:, j, None])[:, 0]
                           for j, lg in enumerate(out.logits)], dim=1).cpu()
        new = new.cpu()
        comps: list[list[Completion]] = [[] for _ in prompts]
        stop_set = set(stops)
        for row in range(new.shape[0]):
            toks = new[row].tolist()
            cut = next((k + 1 for k, tok in enumerate(toks) if tok in stop_set), None)
            reason = "stop" if cut is not None else "length"
            cut = cut or len(toks)
            r = row // p.n
            comps[r].append(Completion(r, row % p.n, prompts[r], toks[:cut], lps[row, :cut].tolist(), reason))
        return comps
