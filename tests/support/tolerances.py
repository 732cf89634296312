"""Tolerances the suite states once, for comparisons where exactness is not the point.

Exact comparisons (``torch.equal``) are kept where the same tensors go through the same kernels: a resumed run, the
same layout twice, weights written and read back. Where the same values meet through different memory or kernel
paths, exactness depends on the CPU's instruction set and is not asserted:
"""

SAME_WEIGHTS_ANOTHER_PATH = dict(rtol=0.0, atol=1e-6)
"""The same fp32 weights (checked equal separately) and inputs through the same model class, held in other memory
(mapped from a file, aligned differently) or run through another kernel path: CPU kernels may vectorise and sum in
another order (measured up to 4e-9 on logits of magnitude <= 1 with AVX2 or AVX-512); a changed weight moves them by
orders more."""

BF16_LAYOUT = dict(rel=1e-2, abs=0.0)
"""A layout's losses under bf16 autocast against stand-alone's under bf16 autocast (same weights, same data): the
same bf16 products summed in another order (split over ranks, micro-batches and stages), each step's update carrying
the difference on. Measured (2-core AVX2 CPU, emulated bf16): 2.8e-4 over 4 steps of the MoE model cut into 2
pipeline stages, where fp32 and bf16 stand-alone differ by 7.7e-4; at most 4.0e-6 on the first-step losses of
tests/trainer/test_task_losses.py's bf16 cases (fp32 and bf16 differ by 1e-5 to 5.8e-4 there). It does not tell bf16
from fp32 (the tests check that the bf16 reference differs from fp32 instead); it catches a layout that fails under
bf16, or that loses or doubles a share of the loss (tens of percent), with room for CPUs whose bf16 kernels (AMX)
round in another order."""

BF16_LAYOUT_GRAD_NORM = dict(rel=5e-2, abs=0.0)
"""The same comparison for gradient norms, which bf16 moves more than the losses: measured 9.3e-3 in the case above
(fp32 and bf16 stand-alone: 5.8e-3); a gradient counted twice or half is 30-100% off."""
