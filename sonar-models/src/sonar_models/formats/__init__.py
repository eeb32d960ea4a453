"""Weight formats: how a model path becomes a config, a tokenizer and a stream of weights."""

from sonar_models.formats.dummy import DummyFormat
from sonar_models.formats.gguf_file import GGUFFormat
from sonar_models.formats.safetensors_folder import SafetensorsFormat

__all__ = ["DummyFormat", "GGUFFormat", "SafetensorsFormat"]
