"""ppo/batch/experience.py: the step's batch, its response-aligned tensors and the merges between role groups."""

from __future__ import annotations

import pytest
import torch

from ppo.batch.experience import Experience, Sample, merge_results, share_samples


def _sample(uid, prompt, response, prompt_index=None):
    return Sample(uid=uid, prompt_index=uid if prompt_index is None else prompt_index, prompt_ids=prompt,
                  response_ids=response, behaviour_logprobs=[-0.5] * len(response), finish_reason="stop")


def test_response_tensors_are_aligned_and_padded():
    exp = Experience([_sample(0, [1, 2], [3, 4, 5]), _sample(1, [1], []), _sample(2, [7, 8, 9], [6])])
    assert exp.max_response_len == 3
    assert exp.response_mask().tolist() == [[True, True, True], [False, False, False], [True, False, False]]
    stacked = exp.stack({0: torch.tensor([1.0, 2.0, 3.0]), 1: torch.tensor([]), 2: torch.tensor([4.0])}, fill=-1)
    assert stacked.tolist() == [[1.0, 2.0, 3.0], [-1.0, -1.0, -1.0], [4.0, -1.0, -1.0]]
    assert exp.behaviour_logprobs().tolist() == [[-0.5] * 3, [0.0] * 3, [-0.5, 0.0, 0.0]]
    assert [s.length for s in exp.samples] == [5, 1, 4]


def test_prompt_units_group_runs_of_one_prompt():
    # GRPO: n=2 samples per prompt, adjacent by uid; a unit packs its prompt once
    exp = Experience([_sample(0, [1, 2, 3], [4], 0), _sample(1, [1, 2, 3], [5, 6], 0),
                      _sample(2, [9], [4], 1), _sample(3, [9], [], 1)])
    units, lengths = exp.prompt_units()
    assert units == [[0, 1], [2, 3]] and lengths == [3 + 1 + 2, 1 + 1 + 0]


def test_share_and_merge_without_a_world_sort_and_refuse_duplicates():
    samples = share_samples([_sample(2, [1], [2]), _sample(0, [1], [3])])
    assert [s.uid for s in samples] == [0, 2]
    with pytest.raises(RuntimeError, match="contributed twice"):
        share_samples([_sample(1, [1], [2]), _sample(1, [1], [2])])
    merged = merge_results({"values": {0: torch.tensor([1.0, 2.0]), 2: torch.tensor([3.0])}, "score": {}})
    assert merged["values"][0].tolist() == [1.0, 2.0] and merged["values"][2].tolist() == [3.0]
    assert merged["score"] == {}
