"""Does our T5 learn as transformers' does? Fine-tune both on the code-summarisation data from the same weights.

A fresh ``t5_tiny`` (seeded) is saved, converted to a transformers checkpoint, and both models are fine-tuned on the
summarisation recipe's data (``tasks/t5/finetune_summarization.yaml``: function source -> first docstring line,
split by file) with the same hyperparameters: ours with our ``Seq2SeqTrainer``, transformers'
``T5ForConditionalGeneration`` with transformers' ``Seq2SeqTrainer`` and ``DataCollatorForSeq2Seq``. Printed: the
held-out loss, ROUGE-L and BLEU of greedy generations, and training time, side by side with their ratios. The data
order differs between the two trainers, so expect agreement within run-to-run noise, not equality.

    python benchmarks/compare_t5_finetune.py                  # 300 steps, 128-token sources, lr 1e-3 (~7 minutes)
    python benchmarks/compare_t5_finetune.py --steps 600 --source-tokens 64 --lr 2e-3   # the recipe's settings
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import transformers

import mindformers_py as mf
from mindformers_py.data.recipe_data import seq2seq_data
from mindformers_py.data.tokenizers.t5 import default_t5_tokenizer
from mindformers_py.metrics import text_generation_metrics
from mindformers_py.recipes.sections import DataSection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--source-tokens", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    cli = parser.parse_args()

    tokenizer = default_t5_tokenizer(vocab_size=4096, extra_ids=100)
    data = DataSection(source="stdlib", objective="docstrings", source_prefix="summarize: ",
                       block_size=cli.source_tokens, max_target_length=32, max_eval_samples=128)
    config = mf.AutoConfig.from_pretrained("t5_tiny", vocab_size=len(tokenizer), dropout_rate=0.1,
                                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                           decoder_start_token_id=tokenizer.pad_token_id)
    splits = seq2seq_data(data, tokenizer, config)
    transformers.set_seed(cli.seed)
    ours = mf.AutoModelForSeq2SeqLM.from_config(config)
    work = Path(tempfile.mkdtemp())
    ours.save_pretrained(work / "ours")
    tokenizer.save_pretrained(work / "ours")
    mf.convert_checkpoint(work / "ours", work / "hf", to="hf")
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(work / "hf")

    settings = dict(per_device_train_batch_size=cli.batch, per_device_eval_batch_size=32, learning_rate=cli.lr,
                    weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=cli.warmup, max_steps=cli.steps,
                    logging_steps=50, eval_strategy="no", save_strategy="no", seed=cli.seed, report_to=[],
                    predict_with_generate=True, generation_max_length=32, generation_num_beams=1, disable_tqdm=True)
    metrics = text_generation_metrics(tokenizer, ["rouge", "bleu"])
    results = {}
    for name, model, args_class, trainer_class, collator in (
        ("transformers", theirs, transformers.Seq2SeqTrainingArguments, transformers.Seq2SeqTrainer,
         transformers.DataCollatorForSeq2Seq(tokenizer, model=theirs)),
        ("ours", ours, mf.Seq2SeqTrainingArguments, mf.Seq2SeqTrainer, None),
    ):
        args = args_class(output_dir=str(work / f"run_{name}"), **settings)
        extra = {"data_collator": collator} if collator is not None else {}
        trainer = trainer_class(model=model, args=args, train_dataset=splits.train, eval_dataset=splits.validation,
                                processing_class=tokenizer, compute_metrics=metrics, **extra)
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        scores = trainer.evaluate()
        results[name] = {"eval loss": scores["eval_loss"], "ROUGE-L": scores["eval_rougeL"],
                         "BLEU": scores["eval_bleu"], "training s": seconds}
        print(f"{name}: {results[name]}", flush=True)

    print(f"\n{cli.steps} steps, batch {cli.batch}, {cli.source_tokens}-token sources, lr {cli.lr}, seed {cli.seed}")
    print(f"{'':>12} {'transformers':>13} {'ours':>10} {'ours / HF':>10}")
    for key in ("eval loss", "ROUGE-L", "BLEU", "training s"):
        a, b = results["transformers"][key], results["ours"][key]
        print(f"{key:>12} {a:13.4f} {b:10.4f} {b / a if a else float('nan'):9.2f}x")


if __name__ == "__main__":
    main()
