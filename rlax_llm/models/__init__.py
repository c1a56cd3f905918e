"""Decoder models, KV cache, loaders, export and tokenizers (see docs/models.md).

``from_pretrained(path, mesh=None, dtype=...) -> (model, tokenizer)`` for a Hugging Face
directory, a hub id ``ORG/NAME`` or a ``.gguf`` file; ``save_pretrained(model, tokenizer,
out_dir)``;
``smollm2_gguf_path()``; ``get_preset(name)`` / ``PRESETS``; ``memory_per_device``;
``create_model`` / ``split_module`` for the functional ``(Model, params)`` form;
``DecoderConfig`` (architecture) with its ``Execution`` (how it runs).
"""

from rlax_llm.models.presets import PRESETS, get_preset, memory_per_device
from rlax_llm.models.decoder import Decoder
from rlax_llm.models.decoder_config import DecoderConfig, Execution, RopeScaling
from rlax_llm.models.files.gguf import smollm2_gguf_path
from rlax_llm.models.kv_cache import KVCache
from rlax_llm.models.model import Model, create_model, split_module
from rlax_llm.models.files.pretrained import from_pretrained, save_pretrained

__all__ = [
    'Decoder', 'DecoderConfig', 'Execution', 'KVCache', 'PRESETS', 'Model', 'RopeScaling',
    'create_model', 'from_pretrained', 'get_preset', 'memory_per_device', 'save_pretrained',
    'smollm2_gguf_path', 'split_module',
]
