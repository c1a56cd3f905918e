"""Corrupt or truncated checkpoint files give one CheckpointError naming the file and the fault.

GGUF cases cut the real SmolLM2 file at points found from its own layout (header, metadata,
tensor-info table, tensor data); Hugging Face cases corrupt a tiny directory written with
``save_pretrained``. Every case asserts the error type, that the message holds the offending
file's path, and a phrase saying what is wrong.
"""

import json
import pathlib
import shutil
import types

import numpy as np
import pytest
from flax import nnx

from rlax_llm.models.files import gguf as gguf_lib
from rlax_llm.models.files import hf
from rlax_llm.models.decoder import Decoder
from rlax_llm.models.decoder_config import DecoderConfig
from rlax_llm.models.files.pretrained import from_pretrained, save_pretrained
from rlax_llm.models.files.tokenizer import HFTokenizer

gguf = pytest.importorskip('gguf')
tokenizers = pytest.importorskip('tokenizers')

from rlax_llm.errors import CheckpointError  # noqa: E402


def _assert_error(excinfo: pytest.ExceptionInfo, path: pathlib.Path, phrase: str) -> None:
  message = str(excinfo.value)
  assert type(excinfo.value) is CheckpointError, message
  assert str(path) in message, message
  assert phrase in message, message


# ----------------------------------------------------------------------------- GGUF


@pytest.fixture(scope='module')
def smollm2_layout():
  """``(path, cuts)``: the real GGUF file and byte counts that end inside each of its parts."""
  try:
    path = gguf_lib.smollm2_gguf_path()
  except FileNotFoundError as error:
    pytest.skip(str(error))
  reader = gguf.GGUFReader(path)
  fields = list(reader.fields.values())
  tokens = reader.fields['tokenizer.ggml.tokens']
  last = fields[-1]
  metadata_end = last.offset + sum(int(part.nbytes) for part in last.parts)
  size = path.stat().st_size
  assert metadata_end + 64 < reader.data_offset < size  # the tensor-info table lies between
  cuts = {
      'header': 12,  # inside the version / tensor count / kv count words
      'metadata_first_field': 40,
      'metadata_token_list': tokens.offset + 100_000,
      'tensor_info_table': (metadata_end + reader.data_offset) // 2,
      'tensor_data_start': reader.data_offset + 1000,
      'tensor_data_middle': (reader.data_offset + size) // 2,
      'tensor_data_last_bytes': size - 10,
  }
  return path, cuts


def _prefix(src: pathlib.Path, dst: pathlib.Path, nbytes: int) -> pathlib.Path:
  with open(src, 'rb') as f:
    dst.write_bytes(f.read(nbytes))
  return dst


@pytest.mark.parametrize('where,phrase', [
    ('header', 'its header'),
    ('metadata_first_field', 'its metadata'),
    ('metadata_token_list', 'its metadata'),
    ('tensor_info_table', 'its tensor-info table'),
    ('tensor_data_start', 'its tensor data'),
    ('tensor_data_middle', 'its tensor data'),
    ('tensor_data_last_bytes', 'its tensor data'),
])
def test_truncated_gguf(smollm2_layout, tmp_path, where, phrase):
  src, cuts = smollm2_layout
  path = _prefix(src, tmp_path / 'cut.gguf', cuts[where])
  with pytest.raises(CheckpointError) as excinfo:
    gguf_lib.read_gguf(path)
  _assert_error(excinfo, path, 'is truncated or corrupt')
  _assert_error(excinfo, path, phrase)
  assert f'({cuts[where]} bytes)' in str(excinfo.value)


def test_truncated_gguf_through_loader_and_tokenizer(smollm2_layout, tmp_path):
  src, cuts = smollm2_layout
  path = _prefix(src, tmp_path / 'cut.gguf', cuts['metadata_first_field'])
  for load in (from_pretrained, HFTokenizer.from_gguf):
    with pytest.raises(CheckpointError) as excinfo:
      load(path)
    _assert_error(excinfo, path, 'is truncated or corrupt: its metadata')


NOT_GGUF = {
    'empty': (b'', 'is empty (0 bytes)'),
    'magic_cut': (b'GGU', 'is truncated: it has only 3 bytes'),
    'text': (b'hello, this is a text file\n', "is not a GGUF file: it starts with b'hell'"),
    'safetensors_renamed': ((2).to_bytes(8, 'little') + b'{}', 'is not a GGUF file'),
}


@pytest.mark.parametrize('case', sorted(NOT_GGUF))
@pytest.mark.parametrize('load', [gguf_lib.read_gguf, from_pretrained, HFTokenizer.from_gguf],
                         ids=['read_gguf', 'from_pretrained', 'from_gguf'])
def test_not_a_gguf_file(tmp_path, case, load):
  content, phrase = NOT_GGUF[case]
  path = tmp_path / 'model.gguf'
  path.write_bytes(content)
  with pytest.raises(CheckpointError) as excinfo:
    load(path)
  _assert_error(excinfo, path, phrase)


def test_gguf_tensor_past_end_of_file_is_caught_even_if_the_reader_accepts_it(
    tmp_path, monkeypatch):
  # gguf.GGUFReader slices its memory map unchecked; were it to return a tensor whose data
  # runs past the end of the file, open_gguf must still refuse it.
  path = tmp_path / 'short.gguf'
  path.write_bytes(b'GGUF' + bytes(996))
  short = types.SimpleNamespace(name='output_norm.weight', data_offset=900, n_bytes=200,
                                data=np.zeros(100, np.uint8))
  monkeypatch.setattr(gguf, 'GGUFReader',
                      lambda _: types.SimpleNamespace(fields={}, tensors=[short]))
  with pytest.raises(CheckpointError) as excinfo:
    gguf_lib.open_gguf(path)
  _assert_error(excinfo, path, "is truncated: tensor 'output_norm.weight' occupies bytes "
                               '900..1100 but the file has only 1000 bytes')


# ----------------------------------------------------------------------------- Hugging Face


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  """A tiny, loadable Hugging Face directory (config, safetensors, tokenizer files)."""
  config = DecoderConfig(vocab_size=32, num_layers=1, embed_dim=16, num_heads=2, num_kv_heads=1,
                         head_dim=8, mlp_dim=32, max_seq_len=16)
  directory = tmp_path_factory.mktemp('hf')
  save_pretrained(Decoder(config, rngs=nnx.Rngs(params=0)), None, directory)
  vocab = {'<eos>': 0, '<unk>': 1, **{chr(ord('a') + i): 2 + i for i in range(26)}}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.save(str(directory / 'tokenizer.json'))
  (directory / 'tokenizer_config.json').write_text(json.dumps({'eos_token': '<eos>'}))
  return directory


def _copy(src: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
  return pathlib.Path(shutil.copytree(src, tmp_path / 'model'))


def test_intact_directory_loads(hf_dir):
  model, tokenizer = from_pretrained(hf_dir)  # the baseline every corruption below departs from
  assert model.config.vocab_size == 32 and tokenizer.eos_id == 0


def _split_safetensors(path: pathlib.Path) -> tuple[dict, bytes]:
  raw = path.read_bytes()
  length = int.from_bytes(raw[:8], 'little')
  return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write_raw(path: pathlib.Path, header: bytes, data: bytes) -> None:
  path.write_bytes(len(header).to_bytes(8, 'little') + header + data)


def _edit_entry(edit):
  """Corruption that applies ``edit`` to the header entry of the embedding."""
  def corrupt(path: pathlib.Path) -> None:
    header, data = _split_safetensors(path)
    edit(header['model.embed_tokens.weight'])
    _write_raw(path, json.dumps(header).encode(), data)
  return corrupt


def _set_entry(key, value):
  return _edit_entry(lambda entry: entry.__setitem__(key, value))


def _drop_entry_key(key):
  return _edit_entry(lambda entry: entry.pop(key))


def _replace_entry(value):
  def corrupt(path: pathlib.Path) -> None:
    header, data = _split_safetensors(path)
    header['model.embed_tokens.weight'] = value
    _write_raw(path, json.dumps(header).encode(), data)
  return corrupt


def _length_past_end(path: pathlib.Path) -> None:
  raw = path.read_bytes()
  path.write_bytes((len(raw) * 2).to_bytes(8, 'little') + raw[8:])


def _raw_header(header: bytes):
  def corrupt(path: pathlib.Path) -> None:
    _, data = _split_safetensors(path)
    _write_raw(path, header, data)
  return corrupt


def _cut(keep):
  """Truncates the file to ``keep(header length, file size)`` bytes."""
  def corrupt(path: pathlib.Path) -> None:
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], 'little')
    path.write_bytes(raw[:keep(8 + length, len(raw))])
  return corrupt


SAFETENSORS_CASES = {
    'empty_file': (_cut(lambda start, size: 0), 'has 0 bytes, too few for a safetensors file'),
    'cut_in_length_prefix': (_cut(lambda start, size: 5), 'has 5 bytes, too few'),
    'length_prefix_past_end': (_length_past_end, '-byte JSON header but only'),
    'cut_inside_header': (_cut(lambda start, size: start // 2), '-byte JSON header but only'),
    'header_not_json': (_raw_header(b'this is not json'), 'header is not valid JSON'),
    'header_not_utf8': (_raw_header(b'{"\xff\xfe": 1}'), 'header is not valid JSON'),
    'header_array': (_raw_header(b'[1, 2, 3]'), 'header is a JSON array, not an object'),
    'entry_not_object': (_replace_entry([1, 2]), 'expected an object with "dtype"'),
    'entry_without_dtype': (_drop_entry_key('dtype'), 'has no dtype in its header entry'),
    'entry_without_shape': (_drop_entry_key('shape'), 'has no shape in its header entry'),
    'entry_without_offsets': (_drop_entry_key('data_offsets'),
                              'has no data_offsets in its header entry'),
    'unknown_dtype': (_set_entry('dtype', 'Q7'), "has dtype 'Q7', not one rlax_llm reads"),
    'dtype_not_a_string': (_set_entry('dtype', 32), 'has dtype 32, not one rlax_llm reads'),
    'negative_shape': (_set_entry('shape', [-32, 16]),
                       'expected a list of non-negative integers'),
    'reversed_offsets': (_set_entry('data_offsets', [2048, 0]),
                         'expected [begin, end] with 0 <= begin <= end'),
    'span_disagrees_with_shape': (_set_entry('shape', [32, 8]),
                                  'spans 2048 bytes (data_offsets [0, 2048]) but its shape'),
    'data_cut_after_header': (_cut(lambda start, size: start), 'is truncated: tensor'),
    'data_cut_in_middle': (_cut(lambda start, size: (start + size) // 2), 'is truncated: tensor'),
    'data_last_byte_missing': (_cut(lambda start, size: size - 1), 'is truncated: tensor'),
}


@pytest.mark.parametrize('case', sorted(SAFETENSORS_CASES))
def test_corrupt_safetensors_fails_on_open(hf_dir, tmp_path, case):
  corrupt, phrase = SAFETENSORS_CASES[case]
  directory = _copy(hf_dir, tmp_path)
  path = directory / 'model.safetensors'
  corrupt(path)
  with pytest.raises(CheckpointError) as excinfo:
    hf.SafetensorsCheckpoint(directory)  # at open time: no tensor has been read yet
  _assert_error(excinfo, path, phrase)
  with pytest.raises(CheckpointError) as excinfo:
    from_pretrained(directory)
  _assert_error(excinfo, path, phrase)


def test_truncated_safetensors_names_the_tensor_and_sizes(hf_dir, tmp_path):
  directory = _copy(hf_dir, tmp_path)
  path = directory / 'model.safetensors'
  header, data = _split_safetensors(path)
  header.pop('__metadata__')
  path.write_bytes(path.read_bytes()[:-1])
  with pytest.raises(CheckpointError) as excinfo:
    hf.read_safetensors_header(path)
  last = max(header, key=lambda name: header[name]['data_offsets'][1])
  begin, end = header[last]['data_offsets']
  _assert_error(excinfo, path, f'is truncated: tensor {last!r} occupies bytes {begin}..{end} '
                               f'of the data section, which holds only {len(data) - 1} bytes')


BAD_JSON = {
    'empty': ('', 'is empty (0 bytes)'),
    'not_json': ('{"vocab_size": 32, "hidden_', 'is not valid JSON'),
    'not_utf8': (b'{"a": "\xff"}', 'is not valid JSON'),
    'array': ('[1, 2, 3]', 'holds a JSON array, not the JSON object'),
    'string': ('"config"', 'holds a JSON string, not the JSON object'),
}


def _write(path: pathlib.Path, content: str | bytes) -> None:
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content)


@pytest.mark.parametrize('case', sorted(BAD_JSON))
def test_bad_config_json(hf_dir, tmp_path, case):
  content, phrase = BAD_JSON[case]
  directory = _copy(hf_dir, tmp_path)
  _write(directory / 'config.json', content)
  with pytest.raises(CheckpointError) as excinfo:
    from_pretrained(directory)
  _assert_error(excinfo, directory / 'config.json', phrase)


@pytest.mark.parametrize('case', sorted(BAD_JSON))
def test_bad_safetensors_index(hf_dir, tmp_path, case):
  content, phrase = BAD_JSON[case]
  directory = _copy(hf_dir, tmp_path)
  index = directory / 'model.safetensors.index.json'
  _write(index, content)
  with pytest.raises(CheckpointError) as excinfo:
    from_pretrained(directory)
  _assert_error(excinfo, index, phrase)


def test_safetensors_index_without_weight_map(hf_dir, tmp_path):
  directory = _copy(hf_dir, tmp_path)
  index = directory / 'model.safetensors.index.json'
  index.write_text(json.dumps({'metadata': {}}))
  with pytest.raises(CheckpointError) as excinfo:
    from_pretrained(directory)
  _assert_error(excinfo, index, '"weight_map" = None; expected an object')


TOKENIZER_CASES = {
    **{f'tokenizer.json-{case}': ('tokenizer.json', *BAD_JSON[case]) for case in BAD_JSON},
    'tokenizer.json-not_a_tokenizer': ('tokenizer.json', '{"model": 3}',
                                       'is JSON but not a tokenizer'),
    'tokenizer_config.json-not_json': ('tokenizer_config.json', '{"eos_token": ',
                                       'is not valid JSON'),
    'special_tokens_map.json-array': ('special_tokens_map.json', '[]',
                                      'holds a JSON array'),
}


@pytest.mark.parametrize('case', sorted(TOKENIZER_CASES))
@pytest.mark.parametrize('load', [from_pretrained, HFTokenizer.from_directory],
                         ids=['from_pretrained', 'from_directory'])
def test_bad_tokenizer_files(hf_dir, tmp_path, case, load):
  name, content, phrase = TOKENIZER_CASES[case]
  directory = _copy(hf_dir, tmp_path)
  _write(directory / name, content)
  with pytest.raises(CheckpointError) as excinfo:
    load(directory)
  _assert_error(excinfo, directory / name, phrase)
