"""What would stop an engine while it loads, checked before a server starts: a model folder that
is not there or not a model the engine serves, a quantization the checkpoint cannot take, a
tensor-parallel size the model does not split into, a draft model that is not there.

Found while loading, these ended a server that was already listening, with tracebacks from the
engine thread (and a worker rank) and exit code 3, "restart me": an orchestrator restarted a
configuration that could never work. Found here, they are one `error:` line and exit code 2, as
a bad flag is. Reads config files only: no weights, no tokenizer, no device; the default model,
not converted yet, is left to the load (which converts it).
"""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.default_model import DEFAULT_MODEL_ALIAS, prepared_default_model, resolve_model
from engine.layers.weight_loading import check_quantization
from engine.models.config import ModelConfig
from engine.parallel.sharding import check_divisible, check_unquantized
from engine.prequantized import read_checkpoint_quant
from engine.spec_decode.config import SpeculativeConfig
from engine.weights import checkpoint_files


def check_startable(config: EngineConfig) -> None:
    """ValueError naming what stops `config` from loading (see the module's docstring)."""
    try:
        model_dir = _folder(config.model)
        if model_dir is not None:
            model_config = ModelConfig.from_dir(model_dir)
            checkpoint_files(model_dir)  # (its FileNotFoundError: an OSError, named below)
            check_quantization(config.quantization, read_checkpoint_quant(model_dir), model_dir)
            if config.tensor_parallel_size > 1:
                check_unquantized(config, model_dir)
                check_divisible(model_config, config.tensor_parallel_size)
        spec = config.speculative_config
        if isinstance(spec, SpeculativeConfig) and spec.method == "draft_model" and spec.model:
            draft_dir = _folder(spec.model)
            if draft_dir is not None:
                ModelConfig.from_dir(draft_dir)
                checkpoint_files(draft_dir)
    except OSError as exc:  # a folder that cannot be read: named as the loader would meet it
        raise ValueError(f"{exc.filename or config.model}: {exc.strerror or exc}") from None
    except (KeyError, TypeError, AttributeError) as exc:  # a config.json without a field, or not an object
        raise ValueError(
            f"{config.model}: config.json cannot be read as a model's ({type(exc).__name__}: {exc})"
        ) from None


def _folder(name: str) -> Path | None:
    """The model folder `name` names, or None for the default model not converted yet: converting
    it (about a minute) is the load's work, and a preflight writes nothing."""
    if name == DEFAULT_MODEL_ALIAS:
        return prepared_default_model()
    return resolve_model(name)
