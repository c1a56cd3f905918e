"""The math scorer: final-answer extraction, score_math's truth table, the math-verify
worker pool's timeout, and fuzzing (never raises, always returns within its timeout)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scorer_checks import SURROGATE, timed  # tests/tasks/scorer_checks.py

from rlax_llm.tasks import math_scorer
from rlax_llm.tasks.math_scorer import (
    SCORERS, extract_final_answer, has_answer_marker, is_mathematical, normalise_answer,
    reference_answer, score_exact, score_math, score_normalised)

# ------------------------------------------------------------------------- extraction


@pytest.mark.parametrize('completion, expected', [
    ('so the total is 5.\n#### 72', '72'),
    ('#### 1,000.', '1,000'),
    ('#### \n', None),
    ('\\boxed{\\frac{1}{2}} then \\boxed{\\frac{3}{4}}', '\\frac{3}{4}'),
    ('\\boxed{\\sqrt{\\frac{a}{b}}}', '\\sqrt{\\frac{a}{b}}'),
    ('\\boxed 7 apples', '7'),
    ('\\boxed{12', None),  # unclosed (truncated): no answer, not the last number
    ('\\fbox{3}', '3'),
    ('I think 3, no 4.5 is it.', '4.5'),
    ('the answer is -17', '-17'),
    ('no numbers here', None),
    ('\u0669\u0665', None),  # Arabic-Indic digits are not numbers here
    ('9' * 300, None),  # longer than MAX_ANSWER_CHARS
    ('x' * 2_000_000 + ' 42', '42'),
    (f'abc{SURROGATE} #### 4', '4'),
    (None, None), (42, None), (b'42', None),
])
def test_extract_final_answer(completion, expected):
  assert extract_final_answer(completion) == expected


def test_has_answer_marker():
  assert has_answer_marker('so #### 3') and has_answer_marker('\\boxed{1}')
  assert has_answer_marker('\\fbox{1}') and not has_answer_marker('the answer is 42')


def test_reference_answer_takes_the_marker_or_the_whole_text():
  assert reference_answer('Natalia sold 48/2 = 24 clips.\n#### 72') == '72'
  assert reference_answer('so $x = \\boxed{6}$.') == '6'
  assert reference_answer(' \\frac{5}{6} ') == '\\frac{5}{6}'
  assert reference_answer('') is None and reference_answer(None) is None


# ------------------------------------------------------------------------- score_math


@pytest.mark.parametrize('completion, answer, reward', [
    ('#### 72', '72', 1.0),
    ('The answer is 72.', 'steps...\n#### 72', 1.0),
    ('#### 72.0', '72', 1.0),
    ('#### 1,000', '1000', 1.0),
    ('#### 73', '72', 0.0),
    ('\\boxed{\\frac{1}{2}}', '0.5', 1.0),
    ('\\boxed{1/2}', '\\frac{1}{2}', 1.0),
    ('\\boxed{\\dfrac{5}{6}}', '\\frac{5}{6}', 1.0),
    ('\\boxed{2\\sqrt{2}}', '\\sqrt{8}', 1.0),
    ('\\boxed{(x+1)^2}', 'x^2+2x+1', 1.0),
    ('\\boxed{\\frac{1}{3}}', '\\frac{1}{2}', 0.0),
    ('\\boxed{5}', '\\boxed{5\\sqrt{2}}', 0.0),
    # Adversarial: huge numbers, overflow, NaN, non-ASCII digits, invalid UTF-8, no answer.
    ('#### ' + '9' * 200, '9' * 200, 1.0),
    ('#### ' + '9' * 200, '1', 0.0),
    ('#### 1e400', '5', 0.0),
    ('#### 1e400', 'inf', 0.0),
    ('#### nan', 'nan', 1.0),  # the same text; no float parsing decides this
    ('#### NaN', '5', 0.0),
    ('\u0669\u0665', '95', 0.0),
    ('#### \u0669\u0665', '95', 0.0),
    (f'#### 4{SURROGATE}', '4', 0.0),
    (f'{SURROGATE} #### 4', '4', 1.0),
    ('', '4', 0.0),
    (None, '4', 0.0),
    ('#### 4', None, 0.0),
    ('#### 4', 4, 0.0),
])
def test_score_math_truth_table(completion, answer, reward):
  assert timed(score_math, completion, answer, limit=30.0) == reward


# Real references: GSM8K's worked answers (#### and calculator notes) and MATH's solutions
# (\boxed{}, its multiple-choice and word answers).
GSM8K_ANSWER = ('Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = '
                '<<48+24=72>>72 clips altogether in April and May.\n#### 72')
GSM8K_THOUSANDS = 'Total: 1200 + 400 = <<1200+400=1600>>1600\n#### 1,600'
MATH_FRACTION = 'Thus the probability is $\\boxed{\\dfrac{5}{12}}$.'
MATH_POLAR = 'So the point is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}.$'
MATH_CHOICE = 'Only (C) holds, so the answer is $\\boxed{\\text{(C)}}$.'
MATH_WORD = 'Hence $f$ is $\\boxed{\\text{odd}}$.'
MATH_LETTERS = 'The word is $\\boxed{cba}$.'


@pytest.mark.parametrize('completion, answer, math, normalised, exact', [
    # math-verify would read letters as a product (abc == cba): words compare as text.
    ('\\boxed{abc}', 'cba', 0.0, 0.0, 0.0),
    ('\\boxed{abc}', MATH_LETTERS, 0.0, 0.0, 0.0),
    ('\\boxed{cba}', MATH_LETTERS, 1.0, 1.0, 1.0),
    ('\\boxed{CBA}', 'cba', 1.0, 1.0, 0.0),
    ('#### 72', GSM8K_ANSWER, 1.0, 1.0, 1.0),
    ('so she sold 72 clips', GSM8K_ANSWER, 1.0, 1.0, 1.0),
    ('#### 72.0', GSM8K_ANSWER, 1.0, 0.0, 0.0),
    ('#### 1600', GSM8K_THOUSANDS, 1.0, 0.0, 0.0),
    ('#### 1,600', GSM8K_THOUSANDS, 1.0, 1.0, 1.0),
    ('#### 71', GSM8K_ANSWER, 0.0, 0.0, 0.0),
    ('\\boxed{\\frac{5}{12}}', MATH_FRACTION, 1.0, 1.0, 0.0),
    ('\\boxed{5/12}', MATH_FRACTION, 1.0, 0.0, 0.0),
    ('\\boxed{(3,\\frac{\\pi}{2})}', MATH_POLAR, 1.0, 1.0, 0.0),
    ('\\boxed{(3, \\pi/3)}', MATH_POLAR, 0.0, 0.0, 0.0),
    ('\\boxed{C}', MATH_CHOICE, 1.0, 1.0, 0.0),
    ('\\boxed{\\text{(D)}}', MATH_CHOICE, 0.0, 0.0, 0.0),
    ('\\boxed{\\text{Odd}}', MATH_WORD, 1.0, 1.0, 0.0),
    ('\\boxed{even}', MATH_WORD, 0.0, 0.0, 0.0),
    ('\\boxed{\\text{New  York}.}', 'new york', 1.0, 1.0, 0.0),
    (None, 'cba', 0.0, 0.0, 0.0),
    ('\\boxed{cba}', None, 0.0, 0.0, 0.0),
])
def test_the_three_scorers_on_real_answers(completion, answer, math, normalised, exact):
  assert [timed(SCORERS[name], completion, answer, limit=30.0)
          for name in ('math', 'normalised', 'exact')] == [math, normalised, exact]
  assert SCORERS['exact'] is score_exact and SCORERS['normalised'] is score_normalised


@pytest.mark.parametrize('reference, mathematical', [
    ('cba', False), ('Monday', False), ('\\text{(C)}', False), ('\\text{no solution}', False),
    ('nan', False), ('x', False), ("o'clock", False),
    ('72', True), ('1,600', True), ('\\frac{5}{12}', True), ('\\pi', True), ('x^2+1', True),
    ('2x', True), ('(3, \\frac{\\pi}{2})', True), ('A, B', True), ('\\infty', True),
])
def test_is_mathematical(reference, mathematical):
  assert is_mathematical(reference) is mathematical


def test_normalise_answer():
  assert normalise_answer('\\text{ New   York }.') == 'new york'
  assert normalise_answer('\\left( 1, \\dfrac{1}{2} \\right)') == '(1,\\frac{1}{2})'
  assert normalise_answer('\\$\\,5\\!') == '5' and normalise_answer('$x + 1$') == 'x+1'
  assert normalise_answer('\\textbf{\\text{(B)}}') == 'b'


def test_score_math_megabytes_of_text_is_fast():
  assert timed(score_math, 'blah ' * 1_000_000 + '#### 12', '12', limit=2.0) == 1.0
  assert timed(score_math, '(' * 3_000_000, '12', limit=2.0) == 0.0
  assert timed(score_math, '\\boxed{' * 500_000, '12', limit=2.0) == 0.0


def test_score_math_slow_expression_is_cut_at_its_timeout():
  score_math('\\boxed{2}', '\\frac{4}{2}', timeout_s=10.0)  # warm a worker up
  before = math_scorer._MATH_WORKERS.timeouts  # pylint: disable=protected-access
  reward = timed(score_math, '\\boxed{10^{10^{10}}}', '3', timeout_s=1.0, limit=4.0)
  assert reward == 0.0
  assert math_scorer._MATH_WORKERS.timeouts == before + 1  # pylint: disable=protected-access
  # The killed worker is replaced: the next answer is still checked.
  assert timed(score_math, '\\boxed{\\frac{6}{4}}', '1.5', limit=30.0) == 1.0


def test_math_verify_is_not_imported_in_this_process():
  """Checked in a fresh interpreter (other tests import torch, which imports sympy)."""
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  code = ('import sys; from rlax_llm.tasks.math_scorer import score_math; '
          "r = score_math('\\\\boxed{\\\\frac{1}{2}}', '0.5'); "
          "print(r, 'math_verify' in sys.modules, 'sympy' in sys.modules)")
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                       check=True, timeout=60).stdout.split()
  assert out == ['1.0', 'False', 'False'], out


# ------------------------------------------------------------------------------ fuzz

_FUZZ_TEXT = st.one_of(
    st.text(max_size=60),
    st.text(alphabet='0123456789.,-+/^{}\\$#() eE', max_size=40),
    st.builds(lambda s: '#### ' + s, st.text(max_size=30)),
    st.builds(lambda s: '\\boxed{' + s + '}', st.text(alphabet='0123456789+-*/^{}()x\\frac',
                                                      max_size=30)),
    st.sampled_from(['1e400', '-1e400', 'nan', 'inf', '\u0669', SURROGATE, '9' * 5000,
                     '\\boxed{' * 50, '}' * 50, '#' * 100]),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(completion=_FUZZ_TEXT, answer=st.sampled_from(['72', '\\frac{1}{2}', '#### 5', 'x+1']))
def test_fuzz_score_math_never_raises_and_is_bounded(completion, answer):
  timed(score_math, completion, answer, timeout_s=2.0, limit=30.0)


@settings(max_examples=200, deadline=None)
@given(completion=st.text(max_size=200))
def test_fuzz_extract_final_answer_never_raises(completion):
  answer = extract_final_answer(completion)
  assert answer is None or (isinstance(answer, str)
                            and len(answer) <= math_scorer.MAX_ANSWER_CHARS)
