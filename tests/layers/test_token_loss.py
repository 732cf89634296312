"""The token cross-entropy scores only the labelled rows on the CPU when most are ignored (masked LM): its loss and
the gradient of every logit (zero for unlabelled rows) must equal the full computation's, in fp32 and bf16, with a
mean and with ``num_items_in_batch``."""

import pytest
import torch
import torch.nn.functional as F

from mindformers_py.layers.loss import IGNORE_INDEX, token_cross_entropy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("labelled", [0.15, 0.9])  # most ignored (rows selected) / most scored (all rows)
@pytest.mark.parametrize("num_items", [None, 7])
def test_selected_rows_give_the_full_loss_and_gradients(dtype, labelled, num_items):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32, 50, generator=g).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (4, 32), generator=g)
    labels[torch.rand(4, 32, generator=g) > labelled] = IGNORE_INDEX
    loss = token_cross_entropy(logits, labels, num_items)
    loss.backward()
    ours = logits.grad.clone()
    logits.grad = None
    full = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="mean" if num_items is None else "sum")
    full = full if num_items is None else full / num_items
    full.backward()
    torch.testing.assert_close(loss, full)
    torch.testing.assert_close(ours, logits.grad)
    assert ours.dtype == dtype and not ours[labels == IGNORE_INDEX].any()
