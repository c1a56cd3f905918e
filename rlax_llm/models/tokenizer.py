"""Tokenizers: text <-> int32 token ids.

``CharTokenizer`` is a self-contained character-level tokenizer for tiny models trained from
scratch on synthetic tasks (``rlax_llm.tasks``): three special ids followed by one id per
alphabet character. It depends on nothing else in the package. The wrapper around Hugging
Face ``tokenizers`` for pretrained checkpoints belongs beside it in this module, with the same
``encode`` / ``decode`` / ``encode_batch`` / ``decode_batch`` surface and the ``pad_id`` /
``bos_id`` / ``eos_id`` / ``vocab_size`` attributes, so tasks and the rollout loop never care
which one they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np


class CharTokenizer:
  """Character-level tokenizer over a fixed alphabet.

  Ids: ``pad_id = 0``, ``bos_id = 1``, ``eos_id = 2``, then ``3 + i`` for ``alphabet[i]``.
  ``vocab_size == 3 + len(alphabet)``.
  """

  pad_id: ClassVar[int] = 0
  bos_id: ClassVar[int] = 1
  eos_id: ClassVar[int] = 2
  num_special: ClassVar[int] = 3

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
    array = np.asarray(ids)
    if array.ndim != 1:
      raise ValueError(f'decode expects a 1-D sequence of ids, got shape {array.shape}; use '
                       'decode_batch for [batch, length] arrays.')
    chars = []
    for token in array.tolist():
      if stop_at_eos and token == self.eos_id:
        break
      chars.append(self._id_to_char.get(token, ''))
    return ''.join(chars)

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
    if isinstance(texts, str):
      raise TypeError(f'encode_batch expects a sequence of strings, got the single string '
                      f'{texts!r}; wrap it in a list or call encode.')
    if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                               or length < 0):
      raise ValueError(f'length must be a non-negative int or None, got {length!r}.')
    encoded = [self.encode(text, add_bos=add_bos, add_eos=add_eos) for text in texts]
    lengths = np.asarray([len(ids) for ids in encoded], dtype=np.int32).reshape(-1)
    width = length if length is not None else int(lengths.max(initial=0))
    for text, ids in zip(texts, encoded):
      if len(ids) > width:
        raise ValueError(f'text {text!r} encodes to {len(ids)} tokens (add_bos={add_bos}, '
                         f'add_eos={add_eos}) but length={width}; raise length or shorten '
                         'the text.')
    batch = np.full((len(encoded), width), self.pad_id, dtype=np.int32)
    for row, ids in enumerate(encoded):
      batch[row, :len(ids)] = ids
    return batch, lengths

  def decode_batch(self, ids: np.ndarray, stop_at_eos: bool = True) -> list[str]:
    """Decodes each row of int ``[B, L]`` ids with ``decode``; returns B strings."""
    array = np.asarray(ids)
    if array.ndim != 2:
      raise ValueError(f'decode_batch expects ids of shape [batch, length], got shape '
                       f'{array.shape}; use decode for a single 1-D sequence.')
    return [self.decode(row, stop_at_eos=stop_at_eos) for row in array]
