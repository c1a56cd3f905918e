"""Tokenization: the ``Tokenizer`` protocol every role codes against, and ``CharTokenizer``.

A leaf module (numpy only): tasks produce text or chat messages and verify text; the model
owns the tokenizer that turns them into ids (docs/architecture.md "Tokenization belongs to the model").
Two implementations share one surface:

* ``CharTokenizer`` (here): a character-level tokenizer for tiny models trained from scratch
  on synthetic tasks: three special ids followed by one id per alphabet character.
* ``rlax_llm.models.files.tokenizer.HFTokenizer``: a Hugging Face ``tokenizers`` vocabulary
  loaded from a checkpoint (directory or GGUF), with its chat template.

Conventions shared by both: ``encode`` adds bos / eos only when asked (``add_bos`` /
``add_eos``); batches are right-padded with ``pad_id``; ``decode(..., stop_at_eos=True)``
drops everything from the first eos on; ids outside the vocabulary decode to nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np

# A chat message, e.g. ``{'role': 'user', 'content': 'What is 2+3?'}``.
Message = Mapping[str, Any]


@runtime_checkable
class Tokenizer(Protocol):
  """What the inference worker, the warm-up and the evaluator need from a tokenizer."""

  @property
  def vocab_size(self) -> int:
    """Every id is in ``[0, vocab_size)``."""
    ...

  @property
  def pad_id(self) -> int:
    ...

  @property
  def bos_id(self) -> int | None:
    ...

  @property
  def eos_id(self) -> int:
    ...

  @property
  def add_bos_token(self) -> bool:
    """Whether the model expects bos in front of a plain-text prompt."""
    ...

  @property
  def chat_template(self) -> str | None:
    """The checkpoint's chat template, or None (then only plain-text prompts work)."""
    ...

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    ...

  def decode(self, ids: Sequence[int] | np.ndarray, stop_at_eos: bool = True) -> str:
    ...

  def encode_batch(self, texts: Sequence[str], length: int | None = None,
                   add_bos: bool = False, add_eos: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Encodes and right-pads ``texts`` with ``pad_id``.

    Args:
      texts: B strings.
      length: padded length L; ``None`` pads to the longest encoding.
      add_bos, add_eos: as in ``encode`` (they count towards the length).

    Returns:
      ``(ids, lengths)``: int32 ``[B, L]`` and int32 ``[B]`` (tokens before the padding).
    Raises ValueError if an encoding is longer than ``length``.
    """
    ...

  def decode_batch(self, ids: np.ndarray, stop_at_eos: bool = True) -> list[str]:
    ...

  def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                          tokenize: bool = False, **kwargs: Any) -> str | list[int]:
    """``messages`` rendered with the chat template; ``tokenize``: ``encode`` of that text
    (no bos added: the template writes its own special tokens)."""
    ...


# Prompts ``encode_prompts`` tokenizes per ``encode_batch`` call (bounds the padded array).
ENCODE_CHUNK = 1024


def encode_prompts(tokenizer: Tokenizer, prompts: Sequence[Any]) -> list[list[int]]:
  """The ids each prompt prompts the model with: the one definition the inference worker
  encodes with and the run's preflight measures with (``rlax_llm.tasks.prompt_length``).

  A prompt (anything with ``text`` and ``messages``, e.g. ``rlax_llm.tasks.Prompt``) with
  chat ``messages`` is rendered by the checkpoint's chat template with the assistant header
  appended and encoded without bos (the template writes its own start tokens); one without
  is its ``text``, with bos prepended if the model expects it (``add_bos_token``). Texts are
  encoded in batches of ``ENCODE_CHUNK`` (``encode_batch``), so 100k prompts take seconds.
  ``apply_chat_template(..., tokenize=True)`` of a tokenizer must equal ``encode`` of its
  rendering (both implementations here define it so).

  Returns one list of ints per prompt, in order. Raises ValueError when a chat prompt meets a
  tokenizer without a chat template, or when a text does not encode (a character outside a
  ``CharTokenizer``'s alphabet).
  """
  texts, add_bos = [], []
  for prompt in prompts:
    if prompt.messages:
      if tokenizer.chat_template is None:
        raise ValueError(f'prompt {prompt.prompt_id} is a chat conversation but {tokenizer!r} '
                         'has no chat template; use a checkpoint with one, or a plain-text '
                         'task format.')
      texts.append(tokenizer.apply_chat_template(list(prompt.messages),
                                                 add_generation_prompt=True))
      add_bos.append(False)
    else:
      texts.append(prompt.text)
      add_bos.append(tokenizer.add_bos_token)
  encoded: list[list[int] | None] = [None] * len(texts)
  for bos in (False, True):
    rows = [i for i, b in enumerate(add_bos) if b == bos]
    for start in range(0, len(rows), ENCODE_CHUNK):
      chunk = rows[start:start + ENCODE_CHUNK]
      ids, lengths = tokenizer.encode_batch([texts[i] for i in chunk], add_bos=bos)
      for row, i in enumerate(chunk):
        encoded[i] = ids[row, :lengths[row]].tolist()
  return encoded


def check_batch_args(texts: Sequence[str], length: int | None) -> None:
  """Raises if ``texts`` is a bare string or ``length`` is not a non-negative int or None."""
  if isinstance(texts, str):
    raise TypeError(f'encode_batch expects a sequence of strings, got the single string '
                    f'{texts!r}; wrap it in a list or call encode.')
  if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                             or length < 0):
    raise ValueError(f'length must be a non-negative int or None, got {length!r}.')


def right_pad(texts: Sequence[str], encoded: Sequence[Sequence[int]], length: int | None,
               pad_id: int, add_bos: bool, add_eos: bool) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads B id lists with ``pad_id`` to ``length`` (``None``: the longest).

  Returns ``(ids, lengths)``: int32 ``[B, L]`` and int32 ``[B]``. ``texts`` (B strings) and
  ``add_bos`` / ``add_eos`` only name the culprit when an encoding is longer than ``length``.
  """
  lengths = np.asarray([len(ids) for ids in encoded], dtype=np.int32).reshape(-1)
  width = length if length is not None else int(lengths.max(initial=0))
  for text, ids in zip(texts, encoded):
    if len(ids) > width:
      raise ValueError(f'text {text!r} encodes to {len(ids)} tokens (add_bos={add_bos}, '
                       f'add_eos={add_eos}) but length={width}; raise length or shorten '
                       'the text.')
  batch = np.full((len(encoded), width), pad_id, dtype=np.int32)
  for row, ids in enumerate(encoded):
    batch[row, :len(ids)] = ids
  return batch, lengths


def as_1d_ids(ids: Sequence[int] | np.ndarray) -> list[int]:
  """A 1-D id sequence or array as Python ints; raises on any other rank."""
  array = np.asarray(ids)
  if array.ndim != 1:
    raise ValueError(f'decode expects a 1-D sequence of ids, got shape {array.shape}; use '
                     'decode_batch for [batch, length] arrays.')
  return array.tolist()


def as_2d_ids(ids: np.ndarray) -> np.ndarray:
  """``ids`` as an array of shape ``[B, L]``; raises on any other rank."""
  array = np.asarray(ids)
  if array.ndim != 2:
    raise ValueError(f'decode_batch expects ids of shape [batch, length], got shape '
                     f'{array.shape}; use decode for a single 1-D sequence.')
  return array


class CharTokenizer:
  """Character-level tokenizer over a fixed alphabet.

  Ids: ``pad_id = 0``, ``bos_id = 1``, ``eos_id = 2``, then ``3 + i`` for ``alphabet[i]``.
  ``vocab_size == 3 + len(alphabet)``.
  """

  pad_id: ClassVar[int] = 0
  bos_id: ClassVar[int] = 1
  eos_id: ClassVar[int] = 2
  num_special: ClassVar[int] = 3
  # Prompts of tiny models start with bos (HFTokenizer reports what its checkpoint does).
  add_bos_token: ClassVar[bool] = True

  def __init__(self, alphabet: str):
    """alphabet: non-empty ``str`` of distinct characters, in id order."""
    if not isinstance(alphabet, str):
      raise TypeError(f'CharTokenizer alphabet must be a str, got {type(alphabet).__name__}: '
                      f'{alphabet!r}. Pass the characters as one string, e.g. "0123456789+=".')
    if not alphabet:
      raise ValueError('CharTokenizer alphabet is empty; pass at least one character, '
                       'e.g. "0123456789+=".')
    seen: dict[str, int] = {}
    for position, char in enumerate(alphabet):
      if char in seen:
        raise ValueError(f'CharTokenizer alphabet {alphabet!r} repeats character {char!r} '
                         f'(positions {seen[char]} and {position}); every character must '
                         'appear once.')
      seen[char] = position
    self._alphabet = alphabet
    self._char_to_id = {char: self.num_special + i for i, char in enumerate(alphabet)}
    self._id_to_char = {i: char for char, i in self._char_to_id.items()}

  @property
  def alphabet(self) -> str:
    """The characters with ids ``3 .. vocab_size - 1``, in order."""
    return self._alphabet

  @property
  def vocab_size(self) -> int:
    """Number of ids: the three special ids plus one per alphabet character."""
    return self.num_special + len(self._alphabet)

  def __repr__(self) -> str:
    return f'CharTokenizer(alphabet={self._alphabet!r})'

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Maps ``text`` to ids, one per character, optionally framed by bos / eos.

    Returns a list of ``len(text) + add_bos + add_eos`` Python ints.
    Raises ValueError naming the first character outside the alphabet and its position.
    """
    if not isinstance(text, str):
      raise TypeError(f'encode expects a str, got {type(text).__name__}: {text!r}.')
    ids = [self.bos_id] if add_bos else []
    for position, char in enumerate(text):
      token = self._char_to_id.get(char)
      if token is None:
        raise ValueError(f'character {char!r} at position {position} of {text!r} is not in '
                         f'the tokenizer alphabet {self._alphabet!r}; remove it or build the '
                         'tokenizer with an alphabet that contains it.')
      ids.append(token)
    if add_eos:
      ids.append(self.eos_id)
    return ids

  def decode(self, ids: Sequence[int] | np.ndarray, stop_at_eos: bool = True) -> str:
    """Maps a 1-D sequence of ids back to text.

    pad and bos are skipped; with ``stop_at_eos`` decoding stops at the first eos (otherwise
    eos is skipped too). Ids outside ``[0, vocab_size)`` decode to nothing, so sampled
    garbage never raises. ids: any integer (or integer-valued) sequence or 1-D array.
    """
    chars = []
    for token in as_1d_ids(ids):
      if stop_at_eos and token == self.eos_id:
        break
      chars.append(self._id_to_char.get(token, ''))
    return ''.join(chars)

  def encode_batch(self, texts: Sequence[str], length: int | None = None,
                   add_bos: bool = False, add_eos: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``Tokenizer.encode_batch``: one ``encode`` per text, right-padded."""
    check_batch_args(texts, length)
    encoded = [self.encode(text, add_bos=add_bos, add_eos=add_eos) for text in texts]
    return right_pad(texts, encoded, length, self.pad_id, add_bos, add_eos)

  def decode_batch(self, ids: np.ndarray, stop_at_eos: bool = True) -> list[str]:
    """Decodes each row of int ``[B, L]`` ids with ``decode``; returns B strings."""
    return [self.decode(row, stop_at_eos=stop_at_eos) for row in as_2d_ids(ids)]

  @property
  def chat_template(self) -> None:
    """Character-level models have no chat format: prompts are plain text."""
    return None

  def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = False,
                          tokenize: bool = False, **kwargs: Any) -> str | list[int]:
    """Always raises: a character-level model has no chat format."""
    del messages, add_generation_prompt, tokenize, kwargs
    raise ValueError('CharTokenizer has no chat template; use a plain-text task format '
                     '(task.format=plain) with a character-level model.')
