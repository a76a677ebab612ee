"""Generation: the `RolloutEngine` protocol and its backends.

    from rollout import NativeEngine, RolloutConfig, SamplingParams
    engine = NativeEngine.from_model(model, config=RolloutConfig(max_model_len=512))
    completions = engine.generate(prompt_ids, SamplingParams(temperature=1.0, max_tokens=128, n=8))

`HFEngine` (bench/hf_engine.py) wraps Hugging Face `generate` for comparison; import it from there.
"""

from rollout.base import Completion, RolloutConfig, RolloutEngine, SamplingParams
from rollout.engine import NativeEngine

__all__ = ["Completion", "NativeEngine", "RolloutConfig", "RolloutEngine", "SamplingParams"]
