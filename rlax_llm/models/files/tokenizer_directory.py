"""A Hugging Face tokenizer directory read into ``HFTokenizer``'s constructor arguments.

``HFTokenizer.from_directory`` (``rlax_llm.models.files.tokenizer``) is ``read_directory``: the
``tokenizers.Tokenizer`` of ``tokenizer.json``, and the special tokens, chat template,
``model_max_length`` and ``clean_up_tokenization_spaces`` as ``tokenizer_config.json``,
``special_tokens_map.json`` and ``chat_template.jinja`` give them, read the way
``transformers.AutoTokenizer`` reads them. A bad file is one error naming it.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlax_llm.errors import CheckpointError
from rlax_llm.models.files import hf

if TYPE_CHECKING:
  import tokenizers


# The named special tokens, as ``tokenizer_config.json`` and chat templates call them.
_SPECIAL_TOKEN_NAMES = ('bos_token', 'eos_token', 'unk_token', 'pad_token')
# transformers writes ``model_max_length = int(1e30)`` for "no limit".
_NO_MAX_LENGTH = 10**29


def _token_content(value: Any, name: str, source: str) -> str | None:
  """A special token's text from a config entry: a string, an AddedToken dict, or None."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get('content'), str):
    return value['content']
  raise ValueError(f'{name} in {source} is {value!r}; expected a string, null, or an '
                   'AddedToken dict with a string "content" field.')


def _select_chat_template(value: Any, name: str, source: str) -> str | None:
  """The template called ``name`` from a ``chat_template`` config entry.

  The entry is a single template string, a list of ``{'name': ..., 'template': ...}`` dicts, or
  a mapping from names to templates; a single string is used whatever ``name`` is.
  """
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping):
    named = dict(value)
  elif isinstance(value, list) and all(isinstance(entry, Mapping) and 'name' in entry
                                       and 'template' in entry for entry in value):
    named = {entry['name']: entry['template'] for entry in value}
  else:
    raise ValueError(f'chat_template in {source} is a {type(value).__name__}; expected a '
                     "template string or a list of {'name': ..., 'template': ...} dicts.")
  if name not in named:
    raise ValueError(f'{source} has chat templates {sorted(named)} but none named {name!r}; '
                     'pass chat_template_name= one of those names.')
  return named[name]


def _read_json_object(path: pathlib.Path) -> dict[str, Any]:
  """The JSON object in ``path``, or ``{}`` if there is no such file.

  Raises CheckpointError naming the file if it is empty, not JSON, or not a JSON object.
  """
  if not path.is_file():
    return {}
  return hf.read_json_object(path)


def _tokenizer_from_file(path: pathlib.Path) -> tokenizers.Tokenizer:
  """``tokenizers.Tokenizer.from_file``; CheckpointError naming the file if it cannot load it."""
  import tokenizers
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as error:  # pylint: disable=broad-except
    # tokenizers raises a bare Exception ('expected value at line 1 column 1', ...).
    failure = error
  hf.read_json_object(path)  # Says so when the file is not even a JSON object.
  raise CheckpointError(f'{path} is JSON but not a tokenizer the `tokenizers` library can load '
                        f'({failure}); check that it is a Hugging Face tokenizer.json.'
                        ) from failure


def read_directory(path: str | os.PathLike, chat_template_name: str = 'default'
                   ) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
  """``(backend, arguments)``: a Hugging Face tokenizer directory as ``HFTokenizer(backend,
  **arguments)`` takes it.

  Reads ``tokenizer.json`` (required), ``tokenizer_config.json`` (special tokens as strings
  or AddedToken dicts, ``chat_template``, ``model_max_length``,
  ``clean_up_tokenization_spaces``) and, for special tokens the config leaves out,
  ``special_tokens_map.json``. A ``chat_template.jinja`` file takes precedence over the
  config's template, as in transformers; a config holding a list of named templates gives the
  one called ``chat_template_name``.

  Raises FileNotFoundError naming the path when there is no ``tokenizer.json``, and
  CheckpointError naming the file when one of these files is not valid JSON (or not an
  object), or ``tokenizer.json`` is not a tokenizer ``tokenizers`` can load.
  """
  directory = pathlib.Path(path)
  tokenizer_file = directory / 'tokenizer.json'
  if not tokenizer_file.is_file():
    raise FileNotFoundError(f'no tokenizer.json at {tokenizer_file}; from_directory needs a '
                            'Hugging Face tokenizer directory (tokenizer.json, '
                            'tokenizer_config.json). For a .gguf checkpoint use '
                            'HFTokenizer.from_gguf.')
  config_file = directory / 'tokenizer_config.json'
  config = _read_json_object(config_file)
  special_map = _read_json_object(directory / 'special_tokens_map.json')
  special = {}
  for name in _SPECIAL_TOKEN_NAMES:
    if config.get(name) is not None:
      special[name] = _token_content(config[name], name, str(config_file))
    else:
      special[name] = _token_content(special_map.get(name), name,
                                     str(directory / 'special_tokens_map.json'))
  template_file = directory / 'chat_template.jinja'
  if template_file.is_file():
    chat_template = template_file.read_text(encoding='utf-8')
  else:
    chat_template = _select_chat_template(config.get('chat_template'), chat_template_name,
                                          str(config_file))
  max_length = config.get('model_max_length')
  if isinstance(max_length, float) and max_length.is_integer():
    max_length = int(max_length)
  if not isinstance(max_length, int) or not 0 < max_length < _NO_MAX_LENGTH:
    max_length = None
  return _tokenizer_from_file(tokenizer_file), dict(
      **special, chat_template=chat_template, model_max_length=max_length,
      clean_up_tokenization_spaces=bool(config.get('clean_up_tokenization_spaces', False)),
      source=str(directory))
