"""Tests for rlax_llm.tokenization.CharTokenizer."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlax_llm.tokenization import CharTokenizer

ALPHABET = '0123456789+-*='
alphabet_text = st.text(alphabet=ALPHABET, max_size=20)


@pytest.fixture
def tok():
  return CharTokenizer(ALPHABET)


def test_id_layout(tok):
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size == 3 + len(ALPHABET) == 17
  assert tok.encode('01=') == [3, 4, 16]
  assert tok.encode('1', add_bos=True, add_eos=True) == [1, 4, 2]
  assert tok.encode('') == []


@settings(max_examples=50, deadline=None)
@given(text=alphabet_text, add_bos=st.booleans(), add_eos=st.booleans())
def test_encode_decode_round_trip(text, add_bos, add_eos):
  tok = CharTokenizer(ALPHABET)
  ids = tok.encode(text, add_bos=add_bos, add_eos=add_eos)
  assert len(ids) == len(text) + add_bos + add_eos
  assert all(0 <= i < tok.vocab_size for i in ids)
  assert tok.decode(ids) == text
  assert tok.decode(np.asarray(ids, dtype=np.int32)) == text


def test_decode_skips_pad_and_bos_and_stops_at_eos(tok):
  ids = [tok.bos_id, 4, tok.pad_id, 5, tok.eos_id, 6, tok.pad_id]
  assert tok.decode(ids) == '12'
  assert tok.decode(ids, stop_at_eos=False) == '123'
  assert tok.decode([tok.eos_id, 4]) == ''


def test_decode_drops_unknown_ids(tok):
  assert tok.decode([-1, 4, 17, 10**30, 5, -(10**30)]) == '12'
  assert tok.decode(np.asarray([99, 4, -7], dtype=np.int64)) == '1'


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(min_value=-(2**70), max_value=2**70), max_size=20))
def test_decode_never_raises_on_arbitrary_ids(ids):
  tok = CharTokenizer(ALPHABET)
  text = tok.decode(ids, stop_at_eos=False)
  assert set(text) <= set(ALPHABET)
  assert len(text) == sum(3 <= i < tok.vocab_size for i in ids)


def test_encode_unknown_character_error_names_char_position_and_alphabet(tok):
  with pytest.raises(ValueError, match=r"character 'x' at position 3 .*'0123456789\+-\*='"):
    tok.encode('12+x=')


def test_decode_rejects_2d_input(tok):
  with pytest.raises(ValueError, match='decode_batch'):
    tok.decode(np.zeros((2, 3), np.int32))


@pytest.mark.parametrize('alphabet, message', [
    ('', 'empty'),
    ('abca', r"repeats character 'a' \(positions 0 and 3\)"),
])
def test_bad_alphabet_raises(alphabet, message):
  with pytest.raises(ValueError, match=message):
    CharTokenizer(alphabet)


def test_non_string_alphabet_raises():
  with pytest.raises(TypeError, match='must be a str'):
    CharTokenizer(['a', 'b'])


def test_encode_batch_pads_to_longest(tok):
  ids, lengths = tok.encode_batch(['12', '', '3+4='], add_eos=True)
  assert ids.dtype == np.int32 and lengths.dtype == np.int32
  assert ids.shape == (3, 5)
  np.testing.assert_array_equal(lengths, [3, 1, 5])
  np.testing.assert_array_equal(ids, [[4, 5, 2, 0, 0],
                                      [2, 0, 0, 0, 0],
                                      [6, 13, 7, 16, 2]])


def test_encode_batch_explicit_length_and_bos(tok):
  ids, lengths = tok.encode_batch(['1', '22'], length=6, add_bos=True)
  assert ids.shape == (2, 6)
  np.testing.assert_array_equal(lengths, [2, 3])
  np.testing.assert_array_equal(ids[1], [1, 5, 5, 0, 0, 0])


def test_encode_batch_empty():
  ids, lengths = CharTokenizer('ab').encode_batch([], length=4)
  assert ids.shape == (0, 4) and lengths.shape == (0,)
  ids, lengths = CharTokenizer('ab').encode_batch([])
  assert ids.shape == (0, 0)


def test_encode_batch_too_long_names_text_and_lengths(tok):
  with pytest.raises(ValueError, match=r"text '12345' encodes to 6 tokens .*length=4"):
    tok.encode_batch(['1', '12345'], length=4, add_eos=True)


def test_encode_batch_rejects_single_string(tok):
  with pytest.raises(TypeError, match='wrap it in a list'):
    tok.encode_batch('123')


@settings(max_examples=30, deadline=None)
@given(texts=st.lists(alphabet_text, min_size=1, max_size=5))
def test_batch_round_trip(texts):
  tok = CharTokenizer(ALPHABET)
  ids, lengths = tok.encode_batch(texts, add_bos=True, add_eos=True)
  assert ids.shape == (len(texts), max(len(t) for t in texts) + 2)
  np.testing.assert_array_equal(lengths, [len(t) + 2 for t in texts])
  for row, n in zip(ids, lengths):
    assert np.all(row[n:] == tok.pad_id)
  assert tok.decode_batch(ids) == texts


def test_decode_batch_rejects_1d(tok):
  with pytest.raises(ValueError, match=r'\[batch, length\]'):
    tok.decode_batch(np.asarray([4, 5]))
