"""ROUGE (Lin, 2004) with Google's ``rouge_score`` package, as an ``evaluate`` module that loads offline:
``evaluate.load(mindformers_py.metrics.metric_path("rouge"))``; the same arguments and results as the hub's
``rouge`` module (F-measures aggregated over the examples)."""

import datasets
import evaluate
from rouge_score import rouge_scorer, scoring

DEFAULT_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


class Rouge(evaluate.Metric):
    """``compute(predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False,
    tokenizer=None) -> {"rouge1": f, "rouge2": f, "rougeL": f, "rougeLsum": f}``: mean F-measures over the
    examples (``use_aggregator=True``: bootstrap-aggregated mid values, as the hub module; False: one score per
    example). ``references`` may hold several references per example (the best match counts)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description="ROUGE-1, ROUGE-2 and ROUGE-L(sum) F-measures of predictions against references.",
            citation="Lin, C.-Y. (2004). ROUGE: A Package for Automatic Evaluation of Summaries.",
            inputs_description="predictions: list of texts; references: list of texts (or of lists of texts).",
            features=[
                datasets.Features({"predictions": datasets.Value("string"),
                                   "references": datasets.Sequence(datasets.Value("string"))}),
                datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
            ],
        )

    def _compute(self, predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False,
                 tokenizer=None):
        types = list(rouge_types or DEFAULT_TYPES)
        scorer = rouge_scorer.RougeScorer(rouge_types=types, use_stemmer=use_stemmer, tokenizer=tokenizer)
        aggregator = scoring.BootstrapAggregator() if use_aggregator else None
        scores = []
        for prediction, reference in zip(predictions, references):
            score = scorer.score_multi(reference, prediction) if isinstance(reference, list) \
                else scorer.score(reference, prediction)
            if aggregator is not None:
                aggregator.add_scores(score)
            else:
                scores.append(score)
        if aggregator is not None:
            result = aggregator.aggregate()
            return {key: float(value.mid.fmeasure) for key, value in result.items()}
        return {key: [float(s[key].fmeasure) for s in scores] for key in types}
