"""mindformers_py: HuggingFace-compatible transformer models with a Trainer and configuration-driven parallelism.

Importing the package makes our model types known to transformers' Auto classes (a model family loads the first
time transformers looks one up: :mod:`mindformers_py.models.lazy_registration`). The public names below load their
module on first use, so ``import mindformers_py`` (and ``mindformers-py --help``) costs little; ``benchmarks/
bench_startup.py`` measures it against ``import torch, transformers``.
"""

from .models.lazy_registration import CHECKPOINT_LOADER as _CHECKPOINT_LOADER
from .models.lazy_registration import Deferred as _Deferred
from .models.lazy_registration import install as _install_auto_registration
from .utils.lazy_exports import lazy_exports as _lazy_exports

__version__ = "0.2.0"

_EXPORTS = {
    **dict.fromkeys(["AutoImageProcessor", "AutoTokenizer"], "transformers"),
    **dict.fromkeys(["AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForImageClassification",
                     "AutoModelForMaskedImageModeling", "AutoModelForMaskedLM", "AutoModelForMultipleChoice",
                     "AutoModelForNextSentencePrediction", "AutoModelForPreTraining", "AutoModelForQuestionAnswering",
                     "AutoModelForSeq2SeqLM",
                     "AutoModelForSequenceClassification", "AutoModelForTextEncoding",
                     "AutoModelForTokenClassification"], ".auto"),
    "convert_checkpoint": ".convert",
    **dict.fromkeys(["CheckpointError", "ConfigError", "MindFormersError"], ".errors"),
    **dict.fromkeys(["GPTConfig", "GPTDoubleHeadsModel", "GPTForCausalLM", "GPTForQuestionAnswering",
                     "GPTForSequenceClassification", "GPTForTokenClassification", "GPTModel"], ".models.gpt"),
    **dict.fromkeys(["ViTConfig", "ViTForImageClassification", "ViTForMaskedImageModeling", "ViTModel"],
                    ".models.vit"),
    **dict.fromkeys(["BertConfig", "BertForMaskedLM", "BertForMultipleChoice", "BertForNextSentencePrediction",
                     "BertForPreTraining", "BertForQuestionAnswering", "BertForSequenceClassification",
                     "BertForTokenClassification", "BertLMHeadModel", "BertModel"], ".models.bert"),
    **dict.fromkeys(["T5Config", "T5EncoderModel", "T5ForConditionalGeneration", "T5Model"], ".models.t5"),
    **dict.fromkeys(["MoEConfig", "ParallelConfig", "RecomputeConfig"], ".parallel.config"),
    "pipeline": ".pipelines",
    "Seq2SeqTrainer": ".trainer.seq2seq",
    "Trainer": ".trainer.trainer",
    **dict.fromkeys(["Seq2SeqTrainingArguments", "TrainingArguments"], ".trainer.arguments"),
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = _lazy_exports(__name__, _EXPORTS, globals())

_install_auto_registration()
# Our model classes' from_pretrained converts presets and HF checkpoints through the Auto classes' loader.
_CHECKPOINT_LOADER[0] = _Deferred(__name__ + ".auto", "load_model_class")
