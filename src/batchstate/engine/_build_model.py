"""The model a config names: the tiny transformer, or a transformers architecture (`hf` extra)."""

from __future__ import annotations

import torch

from batchstate.base.errors import Error
from batchstate.engine._hf_model import make_hf_model
from batchstate.engine._language_model import LanguageModel
from batchstate.engine._model import make_model
from batchstate.engine._model_config import HF_INSTALL, ModelConfig

__all__ = ["MissingExtra", "build_model"]


class MissingExtra(Error, ImportError):
    """A model needs an optional extra that is not installed; the message says how to add it."""


def build_model(config: ModelConfig, device: torch.device | str = "cpu") -> LanguageModel:
    """`config`'s model on `device`, weights drawn from `config.seed`.

    Raises:
        MissingExtra: a transformers architecture without transformers installed.
        ValueError: sizes the architecture cannot take.
    """
    if config.architecture == "tiny":
        return make_model(config, device)
    try:
        return make_hf_model(config, device)
    except ModuleNotFoundError as error:
        if error.name != "transformers":
            raise
        raise MissingExtra(
            f"the {config.architecture} model needs Hugging Face transformers: {HF_INSTALL}"
        ) from error
