"""BLEU (Papineni et al., 2002) computed by ``sacrebleu`` (Post, 2018: standard tokenisation and smoothing), as an
``evaluate`` module that loads offline: ``evaluate.load(mindformers_py.metrics.metric_path("bleu"))``; the same
arguments and result keys as the hub's ``sacrebleu`` module, with the score also on a 0-1 scale as ``bleu``."""

import datasets
import evaluate
import sacrebleu


class Bleu(evaluate.Metric):
    """``compute(predictions, references, smooth_method="exp", lowercase=False, tokenize="13a",
    use_effective_order=False) -> {"bleu": 0..1, "score": 0..100, "counts", "totals", "precisions", "bp",
    "sys_len", "ref_len"}``: corpus BLEU. ``references`` hold one or several references per prediction (all
    examples the same number)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="Corpus BLEU of predictions against references (sacrebleu).",
            citation="Post, M. (2018). A Call for Clarity in Reporting BLEU Scores.",
            inputs_description="predictions: list of texts; references: list of texts (or of lists of texts).",
            features=[
                datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))}),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, smooth_method="exp", lowercase=False, tokenize="13a",
                 use_effective_order=False):
        references = [r if isinstance(r, list) else [r] for r in references]
        count = len(references[0]) if references else 0
        if any(len(r) != count for r in references):
            raise ValueError("every prediction needs the same number of references")
        streams = [[r[i] for r in references] for i in range(count)]
        result = sacrebleu.corpus_bleu(predictions, streams, smooth_method=smooth_method, lowercase=lowercase,
                                       tokenize=tokenize, use_effective_order=use_effective_order)
        return {"bleu": result.score / 100, "score": result.score, "counts": result.counts, "totals": result.totals,
                "precisions": result.precisions, "bp": result.bp, "sys_len": result.sys_len, "ref_len": result.ref_len}
