"""mindformers_py: HuggingFace-compatible transformer models with a Trainer and configuration-driven parallelism.

Importing the package registers our model types with transformers' Auto classes.
"""

from transformers import AutoImageProcessor, AutoTokenizer

from . import models  # noqa: F401  (registers the families)
from .models import gpt  # noqa: F401
from .models import vit  # noqa: F401
from .models import bert  # noqa: F401
from .models import t5  # noqa: F401
from .auto import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForMaskedImageModeling,
    AutoModelForMaskedLM,
    AutoModelForMultipleChoice,
    AutoModelForNextSentencePrediction,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTextEncoding,
    AutoModelForTokenClassification,
)
from .convert import convert_checkpoint
from .errors import CheckpointError, ConfigError, MindFormersError
from .models.gpt import (
    GPTConfig,
    GPTDoubleHeadsModel,
    GPTForCausalLM,
    GPTForQuestionAnswering,
    GPTForSequenceClassification,
    GPTForTokenClassification,
    GPTModel,
)
from .models.vit import ViTConfig, ViTForImageClassification, ViTForMaskedImageModeling, ViTModel
from .models.bert import (
    BertConfig,
    BertForMaskedLM,
    BertForMultipleChoice,
    BertForNextSentencePrediction,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertLMHeadModel,
    BertModel,
)
from .models.t5 import T5Config, T5EncoderModel, T5ForConditionalGeneration, T5Model
from .parallel import MoEConfig, ParallelConfig, RecomputeConfig
from .pipelines import pipeline
from .trainer import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

__version__ = "0.1.0"

__all__ = [
    "AutoConfig", "AutoModel", "AutoModelForCausalLM", "AutoModelForImageClassification", "AutoModelForMaskedLM",
    "AutoModelForQuestionAnswering", "AutoModelForSeq2SeqLM", "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification", "AutoTokenizer", "convert_checkpoint", "GPTConfig", "GPTModel",
    "GPTForCausalLM", "GPTForSequenceClassification", "GPTForTokenClassification", "GPTForQuestionAnswering",
    "MindFormersError", "ConfigError", "CheckpointError", "ParallelConfig", "RecomputeConfig", "MoEConfig",
    "Trainer", "TrainingArguments", "pipeline",
    "AutoImageProcessor", "ViTConfig", "ViTModel", "ViTForImageClassification",
    "BertConfig", "BertModel", "BertForMaskedLM", "BertForSequenceClassification", "BertForTokenClassification",
    "BertForQuestionAnswering", "BertForPreTraining", "BertLMHeadModel", "BertForMultipleChoice",
    "BertForNextSentencePrediction", "GPTDoubleHeadsModel", "ViTForMaskedImageModeling", "AutoModelForMultipleChoice",
    "AutoModelForPreTraining", "AutoModelForNextSentencePrediction", "AutoModelForMaskedImageModeling",
    "AutoModelForTextEncoding", "Seq2SeqTrainer", "Seq2SeqTrainingArguments", "T5Config", "T5Model", "T5ForConditionalGeneration", "T5EncoderModel",
]
