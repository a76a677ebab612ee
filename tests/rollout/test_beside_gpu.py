"""rollout/beside.py on a GPU: the decode steps run on their own CUDA stream (graph replays included) while this
thread keeps the default stream busy with matmuls, and every token sampled before, beside and after carries the
log-prob of the version that sampled it (fp32, against the trainer's forward on the CPU).

    pytest -m gpu tests/rollout/test_beside_gpu.py
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from rollout import NativeEngine
from rollout.beside import DecodeBeside
from rollout.partial import PartialRollouts
from tests.rollout.test_engine import PROMPTS, config
from tests.rollout.test_partial import _check_against_trainer, _params, _versions

pytestmark = pytest.mark.gpu


def test_decoding_beside_cuda_work_keeps_every_token_on_its_version():
    models = _versions()  # on the CPU: the reference forwards
    cfg = config(max_num_seqs=8, max_model_len=224, kv_cache_tokens=224 * 16)
    engine = NativeEngine.from_model(copy.deepcopy(models[0]).cuda(), config=cfg)
    rollouts = PartialRollouts(engine, version=0)
    for i, cap in enumerate((3, 160, 5, 160)):
        rollouts.add_group(PROMPTS[i], _params(40 + i, max_tokens=cap))
    first = rollouts.run_until(groups=2)
    assert sorted(g[0].group for g in first) == [0, 2] and len(engine.runner.graphs) > 0
    graphs = len(engine.runner.graphs)
    beside = DecodeBeside(rollouts, device="cuda")
    assert beside._stream.priority < torch.cuda.current_stream().priority  # ahead of the trainer's kernels
    a, ran, t0 = torch.randn(4096, 4096, device="cuda"), 0, time.perf_counter()
    while ran < 8 or beside.steps < 10:  # the trainer's stand-in, on the default stream
        a = torch.tanh(a @ a.T / 64)
        ran += 1
        if ran % 16 == 0:
            torch.cuda.current_stream().synchronize()
        assert time.perf_counter() - t0 < 120, "the decoding beside made no progress"
    report = beside.stop()
    left = engine.is_decoding()  # rows the thread did not finish continue under version 1
    rollouts.suspend()
    assert ran > 0 and report["async/beside_tokens"] >= 10 * 4 and torch.isfinite(a).all()
    assert len(engine.runner.graphs) == graphs  # nothing captured beside training
    rollouts.swap_weights(models[1].state_dict().items(), version=1)
    rest = rollouts.run_until(groups=2)
    assert sorted(g[0].group for g in rest) == [1, 3]
    for group in first + rest:
        for t in group:  # a GPU's fp32 against the CPU's: 1e-4 (as tests/rollout/test_engine_gpu)
            _check_against_trainer(t, models, atol=1e-4)
    assert not left or any(set(t.versions) == {0, 1} for g in rest for t in g)
