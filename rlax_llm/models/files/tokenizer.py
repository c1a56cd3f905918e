"""``HFTokenizer``: a checkpoint's tokenizer (Hugging Face directory or GGUF metadata).

A wrapper over a Hugging Face ``tokenizers.Tokenizer`` implementing
``rlax_llm.tokenization.Tokenizer`` (the protocol ``CharTokenizer`` implements too), loaded
from a Hugging Face directory (``tokenizer.json`` and friends) or from a GGUF file's metadata,
with the checkpoint's chat template rendered the way ``transformers`` renders it
(``rlax_llm.models.files.chat_template``). It gives the same ids as ``transformers.AutoTokenizer``
on the same files, and ``save`` writes a directory ``AutoTokenizer.from_pretrained`` loads
back. ``encode`` adds bos / eos only when asked (``add_bos`` / ``add_eos``), never because the
checkpoint's post-processor would. Where its arguments come from is
``tokenizer_directory.read_directory`` (a Hugging Face directory) and
``gguf_tokenizer.read_gguf_tokenizer`` (GGUF metadata).
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from rlax_llm import tokenization
from rlax_llm.models.files import chat_template as chat_template_lib
from rlax_llm.models.files import gguf_tokenizer
from rlax_llm.models.files import tokenizer_directory

if TYPE_CHECKING:
  import tokenizers


def _clean_up_tokenization(text: str) -> str:
  """Removes the spaces WordPiece-style decoding leaves before punctuation and contractions.

  The replacements of transformers' ``clean_up_tokenization``, which it applies to non-BPE
  tokenizers whose config sets ``clean_up_tokenization_spaces``.
  """
  for before, after in ((' .', '.'), (' ?', '?'), (' !', '!'), (' ,', ','), (" ' ", "'"),
                        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                        (" 're", "'re")):
    text = text.replace(before, after)
  return text


class HFTokenizer:
  """A Hugging Face ``tokenizers.Tokenizer`` implementing ``rlax_llm.tokenization.Tokenizer``.

  Build it with ``from_directory`` (a Hugging Face tokenizer directory) or ``from_gguf`` (a
  GGUF checkpoint's metadata). Ids and text match ``transformers.AutoTokenizer`` on the same
  files: ``encode(text)`` equals ``tok(text, add_special_tokens=False)['input_ids']``,
  special tokens written in the text (``'<|im_start|>'``) encode to their single ids, and
  ``decode(ids, stop_at_eos=False, skip_special_tokens=s)`` equals
  ``tok.decode(ids, skip_special_tokens=s)``.

  bos / eos are added only when ``encode`` is asked to (``add_bos`` / ``add_eos``), never by
  the checkpoint's post-processor; ``add_bos_token`` / ``add_eos_token`` say what that
  post-processor adds, i.e. what ``tok(text)`` with ``add_special_tokens=True`` would add.
  Chat-formatted prompts already carry their specials and take ``add_bos=False``.

  ``pad_id`` is the declared pad token's id, or ``eos_id`` when the checkpoint declares no pad
  token; ``bos_id`` is None when it declares no bos token.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, eos_token: str | None,
               bos_token: str | None = None, pad_token: str | None = None,
               unk_token: str | None = None, chat_template: str | None = None,
               model_max_length: int | None = None,
               clean_up_tokenization_spaces: bool = False, source: str = 'in-memory tokenizer'):
    """Wraps ``tokenizer``, whose padding and truncation are switched off (``encode_batch``
    pads itself).

    Args:
      tokenizer: the ``tokenizers.Tokenizer``; the wrapper owns it from now on.
      eos_token: the text of the end-of-sequence token (generation stops on it); required.
      bos_token, pad_token, unk_token: the text of those special tokens, or None if the
        checkpoint has none. Every given token must be in the vocabulary.
      chat_template: a jinja2 chat template, or None.
      model_max_length: the longest sequence the model takes, or None if unknown.
      clean_up_tokenization_spaces: the transformers flag of that name; it affects ``decode``
        of non-BPE models only (transformers ignores it for BPE).
      source: where the tokenizer came from, for error messages and ``repr``.
    """
    import tokenizers
    if not isinstance(tokenizer, tokenizers.Tokenizer):
      raise TypeError(f'HFTokenizer wraps a tokenizers.Tokenizer, got '
                      f'{type(tokenizer).__name__}; load one with HFTokenizer.from_directory '
                      'or HFTokenizer.from_gguf.')
    if eos_token is None:
      raise ValueError(f'{source} declares no eos token; HFTokenizer needs one to stop '
                       'generation. Pass eos_token= (e.g. the end-of-turn token of the chat '
                       'template).')
    tokenizer.no_padding()
    tokenizer.no_truncation()
    self._tokenizer = tokenizer
    self._source = source
    self._special_tokens = {'bos_token': bos_token, 'eos_token': eos_token,
                            'unk_token': unk_token, 'pad_token': pad_token}
    self._special_ids: dict[str, int | None] = {}
    for name, token in self._special_tokens.items():
      if token is not None and not isinstance(token, str):
        raise TypeError(f'{name} must be a str or None, got {type(token).__name__}: {token!r}.')
      token_id = None if token is None else tokenizer.token_to_id(token)
      if token is not None and token_id is None:
        raise ValueError(f'{name} {token!r} of {source} is not in its vocabulary; pass a '
                         f'token the tokenizer knows (or None for {name}).')
      self._special_ids[name] = token_id
    if chat_template is not None and not isinstance(chat_template, str):
      raise TypeError(f'chat_template must be a str or None, got '
                      f'{type(chat_template).__name__}; pick one template from a named set.')
    self._chat_template = chat_template
    if model_max_length is not None and (isinstance(model_max_length, bool)
                                         or not isinstance(model_max_length, int)
                                         or model_max_length <= 0):
      raise ValueError(f'model_max_length must be a positive int or None, got '
                       f'{model_max_length!r}.')
    self._model_max_length = model_max_length
    self._clean_up = bool(clean_up_tokenization_spaces) and (
        type(tokenizer.model).__name__ != 'BPE')
    self._clean_up_tokenization_spaces = bool(clean_up_tokenization_spaces)
    self._vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    prefix, suffix = self._post_processor_frame()
    self._add_bos_token = self.bos_id is not None and self.bos_id in prefix
    self._add_eos_token = self.eos_id in suffix

  def _post_processor_frame(self) -> tuple[list[int], list[int]]:
    """The ids the backend's post-processor puts before and after a single sequence.

    Found by encoding a probe text with and without ``add_special_tokens``; the probe is the
    first of a few plain strings whose encoding holds neither bos nor eos, so that a frame of
    bos == eos is still read the right way round. ``([], [])`` if no probe qualifies.
    """
    framing = {self.bos_id, self.eos_id}
    for probe in ('a', 'hello', '0', ' ', '.'):
      plain = self._tokenizer.encode(probe, add_special_tokens=False).ids
      if not plain or framing & set(plain):
        continue
      framed = self._tokenizer.encode(probe, add_special_tokens=True).ids
      for start in range(len(framed) - len(plain) + 1):
        if framed[start:start + len(plain)] == plain:
          return framed[:start], framed[start + len(plain):]
    return [], []

  # ----------------------------------------------------------------------------- loading

  @classmethod
  def from_directory(cls, path: str | os.PathLike, chat_template_name: str = 'default'
                     ) -> HFTokenizer:
    """Loads a Hugging Face tokenizer directory: ``tokenizer.json`` (required),
    ``tokenizer_config.json``, ``special_tokens_map.json``, ``chat_template.jinja``, read as
    transformers reads them (``tokenizer_directory.read_directory``: which file gives what,
    what a config with several named templates gives, and the errors).
    """
    backend, arguments = tokenizer_directory.read_directory(path, chat_template_name)
    return cls(backend, **arguments)

  @classmethod
  def from_gguf(cls, path_or_reader: str | os.PathLike | Any) -> HFTokenizer:
    """Builds the tokenizer a GGUF checkpoint's metadata describes (``path_or_reader``: a
    ``.gguf`` path or a ``gguf.GGUFReader`` open on one); the tokenizer transformers builds
    with ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``
    (``gguf_tokenizer.read_gguf_tokenizer``: the fields read, the models supported, the errors).
    """
    backend, arguments = gguf_tokenizer.read_gguf_tokenizer(path_or_reader)
    return cls(backend, **arguments)

  def save(self, out_dir: str | os.PathLike) -> pathlib.Path:
    """Writes a directory ``transformers.AutoTokenizer.from_pretrained`` loads.

    Files: ``tokenizer.json`` (the full ``tokenizers`` pipeline), ``tokenizer_config.json``
    (``tokenizer_class: 'PreTrainedTokenizerFast'``, the special tokens, ``chat_template``,
    ``model_max_length`` when known, ``add_bos_token`` / ``add_eos_token``,
    ``clean_up_tokenization_spaces``) and ``special_tokens_map.json``. The loaded tokenizer
    gives the same ids and chat rendering; ``from_directory`` on it gives this tokenizer back.
    Creates ``out_dir`` if needed and returns it as a Path.
    """
    directory = pathlib.Path(out_dir)
    directory.mkdir(parents=True, exist_ok=True)
    self._tokenizer.save(str(directory / 'tokenizer.json'))
    config: dict[str, Any] = {
        'tokenizer_class': 'PreTrainedTokenizerFast',
        **self._special_tokens,
        'add_bos_token': self._add_bos_token,
        'add_eos_token': self._add_eos_token,
        'clean_up_tokenization_spaces': self._clean_up_tokenization_spaces,
    }
    if self._model_max_length is not None:
      config['model_max_length'] = self._model_max_length
    if self._chat_template is not None:
      config['chat_template'] = self._chat_template
    special_map = {name: token for name, token in self._special_tokens.items() if token}
    for name, content in (('tokenizer_config.json', config),
                          ('special_tokens_map.json', special_map)):
      with open(directory / name, 'w', encoding='utf-8') as handle:
        json.dump(content, handle, indent=2, ensure_ascii=False)
        handle.write('\n')
    return directory

  # -------------------------------------------------------------------------- attributes

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The wrapped ``tokenizers.Tokenizer``."""
    return self._tokenizer

  @property
  def vocab_size(self) -> int:
    """One more than the largest id, added tokens included: every id is in ``[0, vocab_size)``.
    """
    return self._vocab_size

  @property
  def eos_id(self) -> int:
    """Id of the end-of-sequence token."""
    return self._special_ids['eos_token']

  @property
  def bos_id(self) -> int | None:
    """Id of the beginning-of-sequence token, or None if the checkpoint has none."""
    return self._special_ids['bos_token']

  @property
  def pad_id(self) -> int:
    """Id ``encode_batch`` pads with: the pad token's, else ``eos_id``."""
    pad = self._special_ids['pad_token']
    return self.eos_id if pad is None else pad

  @property
  def unk_id(self) -> int | None:
    """Id of the unknown token, or None."""
    return self._special_ids['unk_token']

  @property
  def special_tokens(self) -> dict[str, str | None]:
    """``{'bos_token', 'eos_token', 'unk_token', 'pad_token'}`` -> token text or None."""
    return dict(self._special_tokens)

  @property
  def chat_template(self) -> str | None:
    """The jinja2 chat template, or None."""
    return self._chat_template

  @property
  def model_max_length(self) -> int | None:
    """The longest sequence the model takes, if the checkpoint says."""
    return self._model_max_length

  @property
  def add_bos_token(self) -> bool:
    """Whether the checkpoint's post-processor prepends bos (transformers'
    ``add_special_tokens=True``). ``encode`` itself only adds bos when asked."""
    return self._add_bos_token

  @property
  def add_eos_token(self) -> bool:
    """Whether the checkpoint's post-processor appends eos; see ``add_bos_token``."""
    return self._add_eos_token

  def __repr__(self) -> str:
    return f'HFTokenizer(source={self._source!r}, vocab_size={self._vocab_size})'

  # ------------------------------------------------------------------------ text <-> ids

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Maps ``text`` to ids, optionally framed by bos / eos.

    Special tokens written in ``text`` encode to their single ids. Returns a list of Python
    ints: ``transformers`` ``tok(text, add_special_tokens=False)['input_ids']``, with
    ``bos_id`` prepended if ``add_bos`` and ``eos_id`` appended if ``add_eos``.
    Raises ValueError for ``add_bos`` when the checkpoint has no bos token.
    """
    if not isinstance(text, str):
      raise TypeError(f'encode expects a str, got {type(text).__name__}: {text!r}.')
    return self._frame(self._tokenizer.encode(text, add_special_tokens=False).ids,
                       add_bos, add_eos)

  def _frame(self, ids: list[int], add_bos: bool, add_eos: bool) -> list[int]:
    """``ids`` with bos prepended / eos appended as asked."""
    if add_bos:
      if self.bos_id is None:
        raise ValueError(f'add_bos=True but {self._source} declares no bos token; encode '
                         'with add_bos=False (chat templates write their own start tokens).')
      ids = [self.bos_id, *ids]
    if add_eos:
      ids = [*ids, self.eos_id]
    return ids

  def decode(self, ids: Sequence[int] | np.ndarray, stop_at_eos: bool = True,
             skip_special_tokens: bool = False) -> str:
    """Maps a 1-D sequence of ids back to text.

    With ``stop_at_eos`` everything from the first eos on is dropped first. Ids outside
    ``[0, vocab_size)`` decode to nothing, so sampled garbage never raises. The rest decodes
    as ``transformers`` ``tok.decode(ids, skip_special_tokens=skip_special_tokens)``: special
    tokens appear as their text unless ``skip_special_tokens``.
    ids: any integer (or integer-valued) sequence or 1-D array.
    """
    values = tokenization.as_1d_ids(ids)
    if stop_at_eos and self.eos_id in values:
      values = values[:values.index(self.eos_id)]
    kept = [int(token) for token in values if 0 <= token < self._vocab_size]
    text = self._tokenizer.decode(kept, skip_special_tokens=skip_special_tokens)
    return _clean_up_tokenization(text) if self._clean_up else text

  def encode_batch(self, texts: Sequence[str], length: int | None = None,
                   add_bos: bool = False, add_eos: bool = False
                   ) -> tuple[np.ndarray, np.ndarray]:
    """``tokenization.Tokenizer.encode_batch``, the texts encoded in one batched call."""
    tokenization.check_batch_args(texts, length)
    texts = list(texts)
    for index, text in enumerate(texts):
      if not isinstance(text, str):
        raise TypeError(f'encode_batch expects strings, got {type(text).__name__} at index '
                        f'{index}: {text!r}.')
    encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
    encoded = [self._frame(encoding.ids, add_bos, add_eos) for encoding in encodings]
    return tokenization.right_pad(texts, encoded, length, self.pad_id, add_bos, add_eos)

  def decode_batch(self, ids: np.ndarray, stop_at_eos: bool = True,
                   skip_special_tokens: bool = False) -> list[str]:
    """Decodes each row of int ``[B, L]`` ids with ``decode``; returns B strings.

    Trailing ``pad_id`` entries of a row are right padding and are dropped before decoding,
    so ``decode_batch(encode_batch(texts)[0])`` gives ``texts`` back. (When ``pad_id ==
    eos_id`` this also drops a row's final eos, which ``stop_at_eos`` drops anyway.)
    """
    texts = []
    for row in tokenization.as_2d_ids(ids):
      values = row.tolist()
      while values and values[-1] == self.pad_id:
        values.pop()
      texts.append(self.decode(values, stop_at_eos=stop_at_eos,
                               skip_special_tokens=skip_special_tokens))
    return texts

  # ------------------------------------------------------------------------- chat format

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = False, tokenize: bool = False,
                          **kwargs: Any) -> str | list[int]:
    """Renders a conversation with the checkpoint's chat template, as transformers does.

    The template sees ``messages`` (prepared by ``chat_template.template_messages``),
    ``add_generation_prompt``, ``tools=None``, ``documents=None``, the special tokens that are
    set (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``) and ``kwargs`` (which
    override all but ``messages`` and ``add_generation_prompt``), rendered by
    ``chat_template.render``.

    Args:
      messages: dicts such as ``{'role': 'user', 'content': 'hi'}``; at least one.
      add_generation_prompt: append the header that starts an assistant turn.
      tokenize: return ids instead of text: ``encode(rendered)``, no bos added (the template
        writes its own special tokens).
      **kwargs: extra template variables (``tools``, ``enable_thinking``, ...).
    Returns the rendered ``str``, or its ids as a list of ints if ``tokenize``.
    Raises ValueError when the tokenizer has no chat template.
    """
    if self._chat_template is None:
      raise ValueError(f'{self._source} has no chat template; build the HFTokenizer with '
                       'chat_template=... or format the prompt yourself and call encode.')
    variables = {name: token for name, token in self._special_tokens.items()
                 if token is not None}
    variables.update(tools=None, documents=None)
    variables.update(kwargs)
    rendered = chat_template_lib.render(self._chat_template, messages,
                                        add_generation_prompt=add_generation_prompt,
                                        **variables)
    return self.encode(rendered) if tokenize else rendered
