"""pack_routing puts each sample's recorded experts at its tokens' packed positions (shared prompts once), -1 at
each sequence's last token and the padding."""

import torch

from ppo.batch.packing import pack_prompt_responses, pack_routing


def _records(prompt, response, seed):
    """Distinct fake records [P + R - 1, 2 layers, 2] whose values encode (sample, position)."""
    n = len(prompt) + len(response) - 1
    return (seed * 100 + torch.arange(n, dtype=torch.int16))[:, None, None].expand(n, 2, 2).clone()


def test_records_land_on_their_tokens_with_and_without_shared_prompts():
    prompts = [[1, 2, 3], [1, 2, 3], [7, 8]]
    responses = [[4, 5], [6], [9, 9, 9]]
    recs = [_records(p, r, i) for i, (p, r) in enumerate(zip(prompts, responses))]
    for share in (False, True):
        packed = pack_prompt_responses(prompts, responses, pad_id=0, share_prompts=share, pad_to_multiple=8)
        row = pack_routing(prompts, recs, num_tokens=packed.num_tokens, share_prompts=share)
        assert row.shape == (packed.num_tokens, 2, 2)
        want = []
        for i, (p, r) in enumerate(zip(prompts, responses)):
            shared = share and i > 0 and prompts[i - 1] == p
            positions = range(len(p) if shared else 0, len(p) + len(r) - 1)
            want += [i * 100 + t for t in positions] + [-1]  # the last token never ran in the engine
        want += [-1] * (packed.num_tokens - len(want))
        assert row[:, 1, 0].tolist() == want
        # position ids agree: each record sits at the token whose position it was recorded at
        pos = packed.position_ids[0].tolist()
        assert all(w == -1 or w % 100 == p for w, p in zip(want, pos))
