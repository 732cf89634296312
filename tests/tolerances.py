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
