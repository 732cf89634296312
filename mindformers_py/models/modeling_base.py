"""What every family's models share: transformers' ``PreTrainedModel`` plus the conventions our runtime relies on."""

from __future__ import annotations


from torch import nn
from transformers import PreTrainedModel
from transformers.utils.output_capturing import OutputRecorder

from ..layers import Attention, TransformerBlock
from ..layers.latent_attention import LatentAttention
from ..layers.moe.layer import Router
from ..task_registry import TaskSpec, task_of_model
from .cache_names import CACHE_NAMES
from .hf_config import own_config
from . import registry
from .registry import register_with_peft


class _TakesHFConfigs(type(PreTrainedModel)):
    """Our model classes take transformers' configs of the architectures their family converts
    (``GPTForCausalLM(LlamaConfig(...))``, ``BertModel(transformers.BertConfig(...))``), as transformers users build
    random-init models: the config is converted before ``__init__`` runs, so the model and all its submodules share
    one config of the family's own class."""

    def __call__(cls, *args, **kwargs):
        if args:
            args = (own_config(cls.config_class, args[0]), *args[1:])
        elif "config" in kwargs:
            kwargs["config"] = own_config(cls.config_class, kwargs["config"])
        return super().__call__(*args, **kwargs)


class MindFormersPreTrainedModel(PreTrainedModel, metaclass=_TakesHFConfigs):
    """Base of every family's pretrained-model class.

    * ``accepts_loss_kwargs``: every head divides its loss by a ``num_items_in_batch`` it is given (the items of the
      whole optimizer step), so transformers' Trainer and ours pass it and do not rescale the loss.
    * ``_can_record_outputs``: transformers' output recording: ``output_hidden_states`` collects each layer's input
      and output (the last replaced by the normed last hidden state), ``output_attentions`` each attention's weights
      (computed under ``attn_implementation="eager"``, as in transformers), ``output_router_logits`` each MoE
      router's logits (tokens, experts).
    * models register the family with peft's defaults when they are built (peft may be imported after us).
    * constructors (and so ``from_config``) take transformers' configs of the architectures the family converts.
    * ``_whole_sequence_modules``: the modules that read the whole sequence (a head that pools or scores positions,
      a pooler), which sequence parallelism gathers the sequence for; declared by each head and base model.
    * ``task_spec``: the training task the model's head serves (task registry), found from its class name as
      transformers finds a model's ``loss_type``; what its pipeline stages compute when no engine gives a task.
    """

    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerBlock"]
    _skip_keys_device_placement = [*CACHE_NAMES]
    _supports_sdpa = True
    _can_record_outputs = {"hidden_states": TransformerBlock, "attentions": [Attention, LatentAttention],
                           "router_logits": OutputRecorder(Router, index=0)}
    accepts_loss_kwargs = True
    _whole_sequence_modules: tuple[str, ...] = ()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load into this class as the Auto classes load (one route for every ``from_pretrained``, whichever class
        is called, so ``dtype``, ``device_map`` and :func:`~mindformers_py.loading.deferred_loading` act the same):
        our checkpoint folders, HF checkpoints of an architecture the family converts
        (``GPTForCausalLM.from_pretrained("path/to/hf_llama")``), presets and hub ids. transformers' own loading
        is left only the case it alone serves: no checkpoint at all (``from_pretrained(None, config=...,
        state_dict=...)``)."""
        loader = registry.checkpoint_loader()
        if loader is None or pretrained_model_name_or_path is None:
            return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return loader(cls, pretrained_model_name_or_path, *model_args, **kwargs)

    def post_init(self) -> None:
        """transformers' ``post_init`` (weights, plans), then our model types into peft's tables if it is loaded."""
        super().post_init()
        self.__dict__.pop("_init_roles", None)
        register_with_peft()

    @property
    def is_gradient_checkpointing(self) -> bool:
        """Whether activation checkpointing is on: transformers' ``is_activation_checkpointing`` under the name
        peft reads when it wraps a model (``get_peft_model``), which transformers 5 keeps only as a deprecated alias
        that warned in every process of a LoRA run."""
        return self.is_activation_checkpointing

    @property
    def task_spec(self) -> TaskSpec | None:
        """The task registry entry of the task this model trains (None for a base model)."""
        return task_of_model(self)

    def weight_role(self, module: nn.Module) -> str:
        """The last part of ``module``'s qualified name in this model (``q_proj``, ``down_proj``, ``lm_head``, ...),
        for inits that depend on a weight's role.

        transformers 5 initialises a model from outside its own package leaf by leaf: a module without parameters
        of its own (an attention, a block) is skipped, so ``_init_weights`` must decide on the leaf itself, and uses
        transformers' ``initialization`` functions, which leave weights loaded from a checkpoint alone."""
        roles = self.__dict__.get("_init_roles")
        if roles is None or module not in roles:
            roles = self.__dict__["_init_roles"] = {m: n.rsplit(".", 1)[-1] for n, m in self.named_modules()}
        return roles.get(module, "")

