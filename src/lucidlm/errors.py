"""lucidlm's own exception types.

Every error a user can trigger with bad input is one of these, with a message that names
the offending file or value and says what to do about it. They also subclass the closest
built-in (ValueError, FileNotFoundError, ...) so generic ``except`` clauses keep working.
"""


class LucidLMError(Exception):
    """Base class of every error lucidlm raises on purpose."""


class ConfigError(LucidLMError, ValueError):
    """A ModelConfig (or a config.json / GGUF metadata we read one from) is invalid."""


class UnsupportedArchitectureError(ConfigError):
    """A checkpoint is for a model family lucidlm does not implement."""


class DeviceError(ConfigError):
    """A device or dtype that is misspelled or not available on this machine."""


class InputError(LucidLMError, ValueError):
    """Token ids or a prompt that the model cannot take."""


class TokenIdError(InputError):
    """A token id below 0 or at/above the vocabulary size."""


class SequenceTooLongError(InputError):
    """A sequence longer than the model's context window (max_seq_len)."""


class WeightsError(LucidLMError, ValueError):
    """A weight file is missing, truncated, or does not fit the model."""


class MissingTensorError(WeightsError, KeyError):
    """A tensor the model needs is absent from the weight file."""

    def __str__(self) -> str:  # KeyError would wrap the message in quotes
        return str(self.args[0]) if self.args else ""


class ShapeMismatchError(WeightsError):
    """A tensor in the weight file has a different shape from the model's parameter."""


class GGUFError(WeightsError):
    """A GGUF file is missing, truncated, corrupted or uses an unsupported type."""


class TokenizerError(LucidLMError, ValueError):
    """A tokenizer cannot be built, loaded, or cannot encode/decode the given input."""


class GenerationError(LucidLMError, ValueError):
    """Bad sampling settings (temperature < 0, top_p outside (0, 1], ...)."""


class ChatTemplateError(GenerationError):
    """A model's chat template that cannot render a conversation: invalid Jinja2, an error
    while rendering, a limit of the sandbox (time, size, depth) or an empty result."""


class DataError(LucidLMError, ValueError):
    """A training corpus that is missing, empty, too small or not UTF-8."""


class CheckpointError(LucidLMError, ValueError):
    """A lucidlm checkpoint that is missing, incomplete or incompatible."""


class AdapterError(LucidLMError, ValueError):
    """A LoRA / adapter / prefix-tuning setup or file that does not fit the base model."""


class QuantizationError(LucidLMError, ValueError):
    """An unknown quantization scheme, a group size that does not fit, or a quantized model
    asked to do what needs float weights (training)."""


class HookError(LucidLMError, KeyError):
    """An unknown hook name, or a layer/head out of range, for inspection tools."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class OutputError(LucidLMError, OSError):
    """An output path that is a file where a directory is needed (or the reverse), lies under
    a file, is not writable, or a write that failed because the disk is full."""

    def __str__(self) -> str:  # OSError would print its args as a tuple
        return str(self.args[0]) if self.args else ""
