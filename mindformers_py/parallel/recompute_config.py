"""Activation recomputation settings: :class:`RecomputeConfig`, the ``recompute`` section of ``ParallelConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, invalid_choice
from ..utils.config_section import _FALSE_STRINGS, _TRUE_STRINGS, _Section, _split_list, _to_int

RECOMPUTE_MODES = (False, "full", "selective")
# Parts of a TransformerBlock that selective recompute can checkpoint: the free function
# layers.attention.attention_core and the block's submodules of these names.
SELECT_RECOMPUTE_CHOICES = ("attention_core", "self_attn", "mlp")


# ---------------------------------------------------------------------------------------------------------------
# Recompute (activation checkpointing)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class RecomputeConfig(_Section):
    """Activation recomputation: trade compute for memory by re-running parts of each layer in backward.

    Shorthands accepted for ``recompute`` (also from YAML/CLI): ``True`` = ``"full"``; ``False``/``0``/``"none"``
    = off; an int ``N`` = ``"full"`` on the first ``N`` layers of each pipeline stage; a list ``[n0, n1, ...]`` =
    ``"full"`` with per-stage counts (MindFormers' list form). ``select_recompute=True`` with recompute off turns
    on ``"selective"`` recompute of the attention core, as in MindFormers.
    """

    recompute: bool | str | int | list[int] = False
    """``False`` (keep activations), ``"full"`` (re-run whole transformer layers) or ``"selective"`` (re-run only
    the parts named in ``select_recompute``); see the class docstring for shorthands."""
    select_recompute: bool | str | list[str] | tuple[str, ...] = ("attention_core",)
    """Parts of each layer re-run by ``"selective"``: ``"attention_core"`` (softmax(qkᵀ)v, the largest
    activations), ``"self_attn"`` (the attention block), ``"mlp"`` (the feed-forward block)."""
    recompute_num_layers: int | str | list[int] | tuple[int, ...] | None = None
    """Which layers recompute applies to: None = every layer; ``N`` = the first ``N`` layers of each pipeline stage
    (of each model chunk with interleaved_1f1b), whose activations live longest under 1F1B; a list = that count
    per pipeline stage (length ``pipeline_stage``, 0 allowed). Ignored when ``recompute`` is False."""

    def _convert(self) -> None:
        mode, layers_from_mode = self._convert_mode(self.recompute)
        select = self._convert_select(self.select_recompute)
        if select is True:
            select = SELECT_RECOMPUTE_CHOICES[:1]
            if mode is False:  # MindFormers: recompute off + select_recompute on = selective recompute
                mode = "selective"
        layers = self.recompute_num_layers
        if isinstance(layers, str) and layers.strip().lower() == "none":
            layers = None
        if layers is not None:
            layers = self._convert_layers(_split_list(layers), "recompute_num_layers")
        if layers_from_mode is not None:
            if layers is not None and layers != layers_from_mode:
                raise ConfigError(
                    f"recompute_num_layers={layers!r} disagrees with recompute={self.recompute!r}; "
                    "give the layer count in one place"
                )
            layers = layers_from_mode
        self.recompute, self.select_recompute, self.recompute_num_layers = mode, select, layers

    @classmethod
    def _convert_mode(cls, value: Any) -> tuple[Any, int | tuple[int, ...] | None]:
        """The ``recompute`` shorthand as (mode, layer counts it carries or None)."""
        mode = value
        if isinstance(mode, str):
            key = mode.strip().lower()
            if key.replace(",", "").replace(" ", "").isdigit():  # "2" or "2,1": layer counts
                mode = _split_list(key)
                mode = int(mode) if isinstance(mode, str) else mode
            elif key in ("true", "yes", "on"):
                mode = True
            elif key in ("false", "no", "off", "none"):
                mode = False
            elif key in RECOMPUTE_MODES[1:]:
                mode = key
        if mode is None:
            mode = False
        if isinstance(mode, (list, tuple)) or (isinstance(mode, int) and not isinstance(mode, bool)):
            layers = cls._convert_layers(mode, "recompute")
            return ("full", layers) if layers else (False, None)  # recompute=0: off
        if mode is True:
            return "full", None
        if mode is False or mode in RECOMPUTE_MODES[1:]:
            return mode, None
        raise ConfigError(
            f"recompute={value!r} is not valid; choose one of: False, True, 'full', 'selective', "
            "a layer count N or per-stage counts [n0, n1, ...]"
        )

    @staticmethod
    def _convert_select(value: Any) -> Any:
        """``select_recompute`` as a tuple of names, or True (MindFormers' "the default selection")."""
        value = _split_list(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE_STRINGS + _FALSE_STRINGS:
            value = value.strip().lower() in _TRUE_STRINGS
        if value is False or value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            return tuple(dict.fromkeys(v.strip() if isinstance(v, str) else v for v in value))
        return value  # True, or something validate() refuses

    @staticmethod
    def _convert_layers(value: Any, name: str) -> int | tuple[int, ...]:
        """A layer count (int >= 0) or per-stage counts (tuple of ints >= 0)."""
        if isinstance(value, (list, tuple)):
            if not value:
                raise ConfigError(f"{name}={value!r} is not valid; expected per-stage layer counts [n0, n1, ...]")
            return tuple(_to_int(name, v, minimum=0) for v in value)
        return _to_int(name, value, minimum=0)

    def validate(self) -> None:
        """Check the mode, the selected parts and the layer counts."""
        if not (self.recompute is False or self.recompute in RECOMPUTE_MODES[1:]):
            raise invalid_choice("recompute", self.recompute, RECOMPUTE_MODES)
        if not isinstance(self.select_recompute, tuple):
            raise ConfigError(
                f"select_recompute={self.select_recompute!r} is not valid; expected a list of: "
                f"{', '.join(SELECT_RECOMPUTE_CHOICES)}"
            )
        for part in self.select_recompute:
            if part not in SELECT_RECOMPUTE_CHOICES:
                raise invalid_choice("select_recompute", part, SELECT_RECOMPUTE_CHOICES)
        if self.recompute == "selective" and not self.select_recompute:
            raise ConfigError(
                "select_recompute=[] is not valid with recompute='selective'; name at least one of: "
                f"{', '.join(SELECT_RECOMPUTE_CHOICES)}"
            )
        layers = self.recompute_num_layers
        counts = layers if isinstance(layers, tuple) else (layers,)
        if layers is not None and not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
            raise ConfigError(
                f"recompute_num_layers={layers!r} is not valid; expected None, an integer >= 1 or per-stage counts"
            )
        if layers == 0:
            raise ConfigError("recompute_num_layers=0 is not valid; use recompute=False to recompute nothing")

    @property
    def enabled(self) -> bool:
        """Whether any recomputation happens."""
        return self.recompute is not False

    def recomputes_layer(self, layer_in_chunk: int, stage: int = 0) -> bool:
        """Whether the ``layer_in_chunk``-th layer (counted from 0 within its stage's model chunk) of pipeline
        ``stage`` is recomputed (fully or selectively, per ``recompute``)."""
        if not self.enabled:
            return False
        layers = self.recompute_num_layers
        if layers is None:
            return True
        if isinstance(layers, tuple):
            if not 0 <= stage < len(layers):
                raise ConfigError(
                    f"recompute_num_layers={list(layers)} has no entry for pipeline stage {stage}; "
                    f"give one count per stage (0..{len(layers) - 1})"
                )
            layers = layers[stage]
        return layer_in_chunk < layers
