"""The prompt-copies kernel of gather_keys' backward (models/triton_gather.py) against the torch path, run
by Triton's CPU interpreter (TRITON_INTERPRET=1) in a child process."""

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")


def test_kernel_equals_the_torch_backward_on_random_layouts():
    out = run_interpreted("""
        import torch
        from models import triton_gather
        from models.document_layout import DocumentLayout, _gather_keys_grad_torch
        from tests.models.test_llama import _random_prefix_rows
        gen = torch.Generator().manual_seed(5)
        checked = 0
        for trial in range(30):
            pos = _random_prefix_rows(gen, int(torch.randint(1, 4, (1,), generator=gen)),
                                      int(torch.randint(2, 40, (1,), generator=gen)))
            lay = DocumentLayout.from_positions(pos)
            if not lay.continues or not lay.prefix_rows.numel():
                continue
            feats = (3, 5) if trial % 2 else (2, 700)  # a partial feature block; two blocks of 1024 wide rows
            dtype = (torch.float32, torch.bfloat16)[trial % 2]
            grad = torch.randn(lay.key_index.numel(), *feats, generator=gen).to(dtype)
            want = _gather_keys_grad_torch(grad, lay.own_index, lay.prefix_rows, lay.prefix_copies)
            got = triton_gather.add_copies_(grad.index_select(0, lay.own_index), grad, lay.prefix_rows,
                                            lay.prefix_copies)
            # the same fp32 sum, in another order: one rounding to dtype apart at most
            tol = 1e-6 if dtype == torch.float32 else 2 ** -7 * want.float().abs().max().item()
            assert (got.float() - want.float()).abs().max().item() <= tol, trial
            checked += 1
        try:
            triton_gather.add_copies_(torch.zeros(4, 3), torch.zeros(5, 2), lay.prefix_rows, lay.prefix_copies)
        except ValueError as e:
            assert "one shape" in str(e)
        else:
            raise AssertionError("mismatched rows were accepted")
        print("checked", checked)
    """)
    assert int(out.split()[-1]) > 8
