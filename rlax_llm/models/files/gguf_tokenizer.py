"""A checkpoint's tokenizer from GGUF metadata: the byte-level BPE a GGUF vocabulary describes.

``HFTokenizer.from_gguf`` (``rlax_llm.models.files.tokenizer``) reads a ``.gguf`` file's
``tokenizer.ggml.*`` fields through ``gguf_fields`` and builds its Hugging Face
``tokenizers.Tokenizer`` with ``byte_level_bpe``: vocabulary ids are token positions, tokens
are spelled in GPT-2's byte alphabet (``byte_to_unicode``), and the pre-tokenizer is the
split pattern of the vocabulary's family (``GGUF_PRE_TOKENIZER_SPLITS``, the patterns
transformers recognises), so the ids equal those of the checkpoint's ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlax_llm.models.files import gguf as gguf_lib

if TYPE_CHECKING:
  import tokenizers


# Split patterns for byte-level BPE vocabularies, keyed by GGUF ``tokenizer.ggml.pre`` (the name
# llama.cpp gives the pre-tokenizer a vocabulary was trained with). Each is the pattern of that
# family's ``tokenizer.json``; names not listed (``gpt2``, ``smollm``, ...) get GPT-2's own split,
# which ``ByteLevel(use_regex=True)`` applies. These are the names transformers recognises too.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(('llama3', 'llama-v3', 'llama-bpe', 'falcon3', 'falcon-h1', 'pixtral',
                     'midm-2.0', 'lfm2', 'jina-v5-nano', 'dbrx', 'smaug-bpe'), _LLAMA3_SPLIT),
    **dict.fromkeys(('qwen2', 'deepseek-r1-qwen', 'kormo', 'f2llmv2', 'megrez'), _QWEN2_SPLIT),
    'qwen35': _QWEN35_SPLIT,
    'tekken': _TEKKEN_SPLIT,
    **dict.fromkeys(('gpt-4o', 'llama4', 'kanana2', 'talkie', 'minimax-m2'), _GPT4O_SPLIT),
}

# GGUF ``tokenizer.ggml.model`` values ``HFTokenizer.from_gguf`` builds (byte-level BPE).
GGUF_TOKENIZER_MODELS = ('gpt2',)
# GGUF ``tokenizer.ggml.token_type`` values (llama.cpp's ``llama_token_type``).
_GGUF_CONTROL = 3
_GGUF_USER_DEFINED = 4


@functools.cache
def byte_to_unicode() -> dict[int, str]:
  """GPT-2's reversible map from the 256 byte values to printable characters.

  Bytes that are printable Latin-1 characters (``!``..``~``, ``¡``..``¬``, ``®``..``ÿ``) map
  to themselves; the 68 others map, in increasing byte order, to ``chr(256)``, ``chr(257)``, ...
  Byte-level BPE vocabularies spell every token in this alphabet (Radford et al., 2019,
  "Language Models are Unsupervised Multitask Learners", section 2.2).
  """
  printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1),
               *range(ord('®'), ord('ÿ') + 1)]
  mapping = {byte: chr(byte) for byte in printable}
  for offset, byte in enumerate(b for b in range(256) if b not in mapping):
    mapping[byte] = chr(256 + offset)
  return mapping


def gguf_fields(path_or_reader: str | os.PathLike | Any) -> tuple[Any, str]:
  """``(get, source)``: ``get(key)`` is a GGUF metadata value (None if absent).

  ``path_or_reader`` is a path to a ``.gguf`` file or an object with a ``fields`` mapping whose
  values have ``contents()`` (a ``gguf.GGUFReader``). ``source`` names it in error messages.
  """
  if isinstance(path_or_reader, (str, os.PathLike)):
    path = pathlib.Path(path_or_reader)
    if not path.is_file():
      raise FileNotFoundError(f'no GGUF file at {path}; pass the path of a .gguf file (or a '
                              'gguf.GGUFReader) to HFTokenizer.from_gguf.')
    reader = gguf_lib.open_gguf(path)  # CheckpointError naming the file if it is corrupt.
    source = str(path)
  else:
    reader = path_or_reader
    filename = getattr(getattr(reader, 'data', None), 'filename', None)  # GGUFReader's memmap
    source = str(filename) if filename else f'{type(reader).__name__} object'
  fields = getattr(reader, 'fields', None)
  if not isinstance(fields, Mapping):
    raise TypeError(f'from_gguf expects a .gguf path or a gguf.GGUFReader, got '
                    f'{type(path_or_reader).__name__}: {path_or_reader!r} (it has no `fields` '
                    'mapping).')

  def get(key: str) -> Any:
    field = fields.get(key)
    return None if field is None else field.contents()

  return get, source


def byte_level_bpe(tokens: Sequence[str], merges: Sequence[str],
                   token_types: Sequence[int], pre: str | None,
                         source: str) -> tokenizers.Tokenizer:
  """The byte-level BPE ``tokenizers.Tokenizer`` a GGUF ``gpt2`` vocabulary describes.

  Vocabulary ids are token positions; a token the file writes in plain UTF-8 rather than in the
  byte alphabet is respelled byte by byte. The pre-tokenizer is GPT-2's ``ByteLevel`` split,
  or the family's split pattern from ``GGUF_PRE_TOKENIZER_SPLITS`` followed by a regex-free
  ``ByteLevel``; the decoder is ``ByteLevel``. Tokens typed CONTROL become special added tokens
  (so ``'<|im_start|>'`` in text encodes to its one id and ``skip_special_tokens`` drops it);
  USER_DEFINED ones become plain added tokens. A CONTROL token outside the byte alphabet is a
  llama.cpp mislabel and is left alone, as transformers does.
  """
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

  to_unicode = byte_to_unicode()
  alphabet = set(to_unicode.values())
  vocab = {}
  for index, token in enumerate(tokens):
    if not set(token) <= alphabet:
      token = ''.join(to_unicode[byte] for byte in token.encode('utf-8'))
    vocab[token] = index
  pairs = []
  for rank, merge in enumerate(merges):
    parts = merge.split(' ')
    if len(parts) != 2:
      raise ValueError(f'tokenizer.ggml.merges[{rank}] in {source} is {merge!r}; a merge must '
                       'be two tokens separated by one space.')
    pairs.append((parts[0], parts[1]))
  backend = Tokenizer(models.BPE(vocab=vocab, merges=pairs, dropout=None,
                                 continuing_subword_prefix='', end_of_word_suffix='',
                                 fuse_unk=False))
  split = GGUF_PRE_TOKENIZER_SPLITS.get(pre)
  if split is None:
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior='isolated'),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  backend.decoder = decoders.ByteLevel()
  typed = list(zip(tokens, token_types))
  backend.add_special_tokens([
      AddedToken(token, special=True, normalized=False) for token, kind in typed
      if kind == _GGUF_CONTROL and set(token) <= alphabet])
  backend.add_tokens([
      AddedToken(token, special=False, normalized=False) for token, kind in typed
      if kind == _GGUF_USER_DEFINED and token in vocab])
  return backend


def read_gguf_tokenizer(path_or_reader: str | os.PathLike | Any
                        ) -> tuple[tokenizers.Tokenizer, dict[str, Any]]:
  """``(backend, arguments)``: the tokenizer a GGUF checkpoint's metadata describes, as
  ``HFTokenizer(backend, **arguments)`` takes it (``HFTokenizer.from_gguf``).

  Supports ``tokenizer.ggml.model == 'gpt2'`` (byte-level BPE; see ``byte_level_bpe``).
  bos / eos / unk / pad come from ``tokenizer.ggml.{bos,eos,unknown,padding}_token_id``, the
  chat template from ``tokenizer.chat_template``, ``model_max_length`` from
  ``{general.architecture}.context_length``, and the post-processor adds bos / eos to
  ``add_special_tokens=True`` encodings iff ``tokenizer.ggml.add_{bos,eos}_token`` say so --
  the tokenizer transformers builds with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``.

  Args:
    path_or_reader: path to a ``.gguf`` file, or a ``gguf.GGUFReader`` already open on one.
  Raises ValueError naming the model for other ``tokenizer.ggml.model`` values, and
  CheckpointError naming the file when it is empty, not GGUF, truncated or corrupt.
  """
  get, source = gguf_fields(path_or_reader)
  model = get('tokenizer.ggml.model')
  if model not in GGUF_TOKENIZER_MODELS:
    raise ValueError(f'{source} has tokenizer.ggml.model={model!r}; HFTokenizer.from_gguf '
                     f'supports {list(GGUF_TOKENIZER_MODELS)} (byte-level '
                     'BPE). For other models load the original tokenizer directory with '
                     'from_directory.')
  tokens = get('tokenizer.ggml.tokens')
  merges = get('tokenizer.ggml.merges')
  if not tokens or merges is None:
    missing = 'tokenizer.ggml.tokens' if not tokens else 'tokenizer.ggml.merges'
    raise ValueError(f'{source} has no {missing}; a byte-level BPE vocabulary needs both '
                     'tokenizer.ggml.tokens and tokenizer.ggml.merges.')
  token_types = get('tokenizer.ggml.token_type') or []
  backend = byte_level_bpe(tokens, merges, token_types,
                                          get('tokenizer.ggml.pre'), source)
  special = {}
  for name, key in (('bos_token', 'bos_token_id'), ('eos_token', 'eos_token_id'),
                    ('unk_token', 'unknown_token_id'), ('pad_token', 'padding_token_id')):
    token_id = get(f'tokenizer.ggml.{key}')
    if token_id is not None and not 0 <= token_id < len(tokens):
      raise ValueError(f'tokenizer.ggml.{key}={token_id} in {source} is outside the '
                       f'vocabulary of {len(tokens)} tokens.')
    special[name] = None if token_id is None else backend.id_to_token(token_id)
  frame = {}
  for name in ('bos', 'eos'):
    token = special[f'{name}_token']
    if get(f'tokenizer.ggml.add_{name}_token') and token is not None:
      frame[name] = (token, backend.token_to_id(token))
  backend.post_processor = template_post_processor(frame.get('bos'), frame.get('eos'))
  architecture = get('general.architecture')
  context = get(f'{architecture}.context_length') if architecture else None
  return backend, dict(**special, chat_template=get('tokenizer.chat_template'),
                       model_max_length=int(context) if context else None, source=source)


def template_post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> Any:
  """transformers' post-processor for ``add_bos_token`` / ``add_eos_token``.

  ``[bos] $A [eos]`` for one sequence and ``[bos] $A [eos] [bos] $B [eos]`` for a pair, each
  bracket present when that ``(token, id)`` is given.
  """
  from tokenizers import processors

  def frame(sequence: str, type_id: int) -> str:
    parts = [f'{bos[0]}:{type_id}'] if bos else []
    parts.append(f'{sequence}:{type_id}')
    if eos:
      parts.append(f'{eos[0]}:{type_id}')
    return ' '.join(parts)

  return processors.TemplateProcessing(
      single=frame('$A', 0), pair=f"{frame('$A', 0)} {frame('$B', 1)}",
      special_tokens=[token for token in (bos, eos) if token])
