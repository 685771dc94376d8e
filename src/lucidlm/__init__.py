"""lucidlm: a glass-box toolkit for decoder-only transformer language models."""

from lucidlm.config import PRESETS, ModelConfig, preset
from lucidlm.errors import LucidLMError
from lucidlm.language_model import LanguageModel
from lucidlm.loading import load
from lucidlm.model import Transformer
from lucidlm.quantization import quantize

__version__ = "0.1.0"
__all__ = ["ModelConfig", "PRESETS", "preset", "Transformer", "LanguageModel", "load", "quantize", "LucidLMError",
           "__version__"]
