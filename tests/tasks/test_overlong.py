"""Overlong prompts found when the run is prepared: ``rlax_llm.tasks.prompt_length``.

Lengths are checked against a brute-force reference: each prompt encoded on its own through
the tokenizer's own calls (``encode`` with bos, ``apply_chat_template(tokenize=True)``), not
through ``encode_prompts``'s batches.
"""

import json
import time

import ml_collections
import numpy as np
import pytest

from rlax_llm import config as config_lib
from rlax_llm import roles, run_config
from rlax_llm.backends.assembly import Run
from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config_file
from rlax_llm.data import prompt_dataset
from rlax_llm.errors import ConfigError
from rlax_llm.tasks import ArithmeticTask, MathTask
from rlax_llm.tasks.prompt_length import dropped_metrics, fit_prompt_length

tokenizers = pytest.importorskip('tokenizers')
pytest.importorskip('jinja2')

from rlax_llm.models.files.tokenizer import HFTokenizer  # after importorskip: needs tokenizers

WORDS = [f'w{i}' for i in range(64)]
SPECIALS = ['<unk>', '<s>', '</s>', '<|im_start|>', '<|im_end|>']
TEMPLATE = ('{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n'
            '{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')


@pytest.fixture(scope='module')
def tokenizer():
  """A word-level tokenizer whose post-processor adds bos (so plain prompts take one) and a
  chat template that writes its own specials."""
  vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + ['user', 'assistant', 'system'])}
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token='<unk>'))
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  backend.add_special_tokens(SPECIALS)
  backend.post_processor = tokenizers.processors.TemplateProcessing(
      single='<s> $A', special_tokens=[('<s>', vocab['<s>'])])
  tok = HFTokenizer(backend, bos_token='<s>', eos_token='</s>', unk_token='<unk>',
                    chat_template=TEMPLATE)
  assert tok.add_bos_token
  return tok


def _records(n, seed, longest=40):
  """``n`` distinct questions (three words spell the index) of 4 .. longest + 3 words."""
  rng = np.random.default_rng(seed)
  size = len(WORDS)
  return [{'question': ' '.join([WORDS[i // size**2 % size], WORDS[i // size % size],
                                 WORDS[i % size]]
                                + [WORDS[(i + j) % size]
                                   for j in range(int(rng.integers(1, longest + 1)))]),
           'answer': f'#### {i}'} for i in range(n)]


def _write(path, rows):
  path.write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return str(path)


def _length(tokenizer, prompt):
  """The brute-force reference: one prompt, the tokenizer's own single calls."""
  if prompt.messages:
    return len(tokenizer.apply_chat_template(list(prompt.messages), add_generation_prompt=True,
                                             tokenize=True))
  return len(tokenizer.encode(prompt.text, add_bos=tokenizer.add_bos_token))


def _lengths(tokenizer, task, rows):
  return [_length(tokenizer, task._make_prompt(i, r)) for i, r in enumerate(rows)]  # pylint: disable=protected-access


def _stream(task):
  """Every train record the stream visits in its first epoch, as prompt text."""
  return [task.train_prompt(i).text for i in range(len(task.split.train))]


def test_the_config_refuses_a_policy_that_does_not_exist():
  config = load_config_file(str(DEFAULT_CONFIG_PATH))
  assert config.sampling.overlong_prompts == 'error'
  config.sampling.overlong_prompts = 'truncate'
  with pytest.raises(ConfigError, match=r"sampling.overlong_prompts='truncate' is not valid"):
    config_lib.validate_config(config)


def test_error_names_the_count_the_longest_some_records_and_both_fixes(tmp_path, tokenizer):
  rows = _records(200, seed=1)
  path = _write(tmp_path / 'train.jsonl', rows)
  task = MathTask(path=path, num_eval=8)
  lengths = _lengths(tokenizer, task, rows)
  limit = 30
  over = [i for i, n in enumerate(lengths) if n > limit]
  assert 0 < len(over) < len(rows)
  with pytest.raises(ConfigError) as raised:
    fit_prompt_length(task, tokenizer, limit, 'error')
  message = str(raised.value)
  assert message.startswith(f'{len(over)} of the {len(rows)} prompts of task \'math\' encode '
                            f'to more than config.sampling.max_prompt_len={limit} tokens')
  assert f'the longest: {max(lengths)} tokens' in message
  longest = next(i for i in over if lengths[i] == max(lengths))
  assert f'record {longest} of path={path!r} ({max(lengths)} tokens)' in message
  assert f'Raise sampling.max_prompt_len to {max(lengths)}' in message
  assert "sampling.overlong_prompts='drop'" in message
  assert task.dropped_records == 0 and len(task.split.train) == len(rows) - 8  # untouched
  assert fit_prompt_length(task, tokenizer, max(lengths), 'error') == 0  # the fix it names


@pytest.mark.parametrize('format', ['plain', 'chat'])
def test_drop_removes_exactly_the_overlong_prompts(tmp_path, tokenizer, format):  # pylint: disable=redefined-builtin
  rows = _records(300, seed=2)
  path = _write(tmp_path / 'train.jsonl', rows)
  kwargs = {'path': path, 'num_eval': 10, 'format': format, 'system_prompt': 'w1 w2'}
  task = MathTask(**kwargs)
  limit = 35 if format == 'chat' else 25
  prompts = [task._make_prompt(i, r) for i, r in enumerate(rows)]  # pylint: disable=protected-access
  short = {p.text for p in prompts if _length(tokenizer, p) <= limit}
  expected = len(rows) - len(short)
  assert 0 < expected < len(rows) - 10
  assert fit_prompt_length(task, tokenizer, limit, 'drop') == expected
  assert task.dropped_records == expected
  assert dropped_metrics(task) == {'data/overlong_dropped': float(expected)}
  evals = task.eval_prompts()
  assert len(evals) == 10  # num_eval still held out, from the prompts that fit
  assert all(_length(tokenizer, p) <= limit for p in evals)
  train = _stream(task)
  assert sorted(train + [p.text for p in evals]) == sorted(short)  # every short one, once
  # Built from the short records alone, the task is the same: drop is "never read".
  kept = _write(tmp_path / 'short.jsonl',
                [r for r, p in zip(rows, prompts) if p.text in short])
  alone = MathTask(**{**kwargs, 'path': kept})
  assert [p.text for p in alone.eval_prompts()] == [p.text for p in evals]
  assert _stream(alone) == train
  assert fit_prompt_length(task, tokenizer, limit, 'error') == 0  # nothing overlong is left


def test_held_out_prompts_are_measured_too(tmp_path, tokenizer):
  train = _write(tmp_path / 'train.jsonl', _records(40, seed=3, longest=10))
  eval_rows = _records(30, seed=4)
  held_out = _write(tmp_path / 'test.jsonl', eval_rows)
  limit = 20
  task = MathTask(path=train, eval_path=held_out, num_eval=5)
  lengths = _lengths(tokenizer, task, eval_rows)
  over = [i for i, n in enumerate(lengths) if n > limit]
  assert 0 < len(over) <= len(eval_rows) - 5
  assert max(_lengths(tokenizer, task, _records(40, seed=3, longest=10))) <= limit
  with pytest.raises(ConfigError, match=rf'^{len(over)} of the 70 prompts .* record '
                     rf'{over[int(np.argmax([lengths[i] for i in over]))]} of '
                     rf'eval_path={held_out!r}'):
    fit_prompt_length(task, tokenizer, limit, 'error')
  assert fit_prompt_length(task, tokenizer, limit, 'drop') == len(over)
  assert len(task.eval_prompts()) == 5
  assert all(_length(tokenizer, p) <= limit for p in task.eval_prompts())
  assert len(task.split.train) == 40  # no train prompt was long
  # Too few held-out prompts left for num_eval: the error says so and names the drop.
  task = MathTask(path=train, eval_path=held_out, num_eval=len(eval_rows) - len(over) + 1)
  with pytest.raises(ConfigError, match=r"overlong_prompts='drop': .*lower num_eval.* "
                     rf'\({len(over)} record\(s\) were left out before the split'):
    fit_prompt_length(task, tokenizer, limit, 'drop')


def test_resume_sees_the_same_stream_and_may_not_change_the_policy(tmp_path, tokenizer):
  path = _write(tmp_path / 'train.jsonl', _records(500, seed=5))

  def dropped():
    task = MathTask(path=path, num_eval=6, seed=3)
    assert fit_prompt_length(task, tokenizer, 22, 'drop') > 0
    return task

  first, second = dropped(), dropped()
  iterator = iter(prompt_dataset(first, 7))
  for _ in range(100):  # past the first epoch's end
    next(iterator)
  state = iterator.get_state()
  expected = [next(iterator) for _ in range(5)]
  resumed = iter(prompt_dataset(second, 7))
  resumed.set_state(state)
  assert [next(resumed) for _ in range(5)] == expected
  assert first.eval_prompts() == second.eval_prompts()
  # The policy decides which prompts exist: a resumed run may not change it (nor the length).
  config = load_config_file(str(DEFAULT_CONFIG_PATH))
  saved = json.loads(config.to_json_best_effort())
  config.sampling.overlong_prompts = 'drop'
  with pytest.raises(ConfigError, match=r"sampling.overlong_prompts: 'error' -> 'drop'"):
    run_config.check_resume_config(saved, config)
  del saved['sampling']['overlong_prompts']  # a run saved before the key: its default resumes
  config.sampling.overlong_prompts = 'error'
  run_config.check_resume_config(saved, config)


def test_generated_tasks_keep_the_workers_check(tokenizer):
  task = ArithmeticTask(seed=0)
  assert fit_prompt_length(task, tokenizer, 1, 'error') == 0
  assert fit_prompt_length(task, tokenizer, 1, 'drop') == 0
  assert dropped_metrics(task) == {}


def test_roles_fit_prompts_reads_the_config(tmp_path, tokenizer):
  path = _write(tmp_path / 'train.jsonl', _records(50, seed=6))
  config = ml_collections.ConfigDict({'sampling': {'max_prompt_len': 16,
                                                   'overlong_prompts': 'drop'}})
  task = MathTask(path=path, num_eval=2)
  expected = sum(n > 16 for n in _lengths(tokenizer, task, _records(50, seed=6)))
  assert roles.fit_prompts(config, task, tokenizer) == expected > 0


def test_a_gsm8k_sized_set_is_measured_in_seconds(tmp_path, tokenizer):
  rows = _records(7_500, seed=7, longest=120)
  path = _write(tmp_path / 'train.jsonl', rows)
  task = MathTask(path=path, num_eval=100, format='chat', system_prompt='w3 w4 w5')
  limit = 100
  start = time.perf_counter()
  dropped = fit_prompt_length(task, tokenizer, limit, 'drop')
  elapsed = time.perf_counter() - start
  assert elapsed < 10.0, f'measuring 7.5k prompts took {elapsed:.1f} s'
  # Brute force on a sample: the batched lengths agree with one-at-a-time encoding.
  sample = [task._make_prompt(i, r) for i, r in enumerate(rows[:500])]  # pylint: disable=protected-access
  over = sum(_length(tokenizer, p) > limit for p in sample)
  assert over > 0 and dropped > over
  assert all(_length(tokenizer, task.train_prompt(i)) <= limit for i in range(0, 7_000, 97))


def test_the_ray_driver_drops_what_prepare_drops(tmp_path, tokenizer):
  """``roles.prepare_task`` (the Ray driver's task: the tokenizer loaded alone, from the
  checkpoint directory) leaves out the same records as ``fit_prompts`` with the model's."""
  tokenizer.save(tmp_path / 'model')
  rows = _records(80, seed=8)
  config = load_config_file(str(DEFAULT_CONFIG_PATH))
  config.model.name, config.model.path = 'auto', str(tmp_path / 'model')
  config.task = ml_collections.ConfigDict({'name': 'math', 'num_eval': 4, 'format': 'chat',
                                           'path': _write(tmp_path / 'train.jsonl', rows)})
  config.sampling.max_prompt_len = 40
  with pytest.raises(ConfigError, match=r'prompts of task .math. encode to more than'):
    roles.prepare_task(config)
  config.sampling.overlong_prompts = 'drop'
  driver = roles.prepare_task(config)
  task = roles.build_task(config)
  assert roles.fit_prompts(config, task, tokenizer) == driver.dropped_records > 0
  assert driver.eval_prompts() == task.eval_prompts()
  assert _stream(driver) == _stream(task)


def test_the_run_writes_the_dropped_count_to_its_summary_once():
  written = []

  class Controller:
    def run(self):
      return {'steps': 2}

  class Writer:
    def write_summary(self, summary):
      written.append(dict(summary))

  run = Run(Controller(), Writer(), {}, {'data/overlong_dropped': 3.0})
  assert run.execute()['data/overlong_dropped'] == 3.0
  assert len(written) == 1 and written[0]['data/overlong_dropped'] == 3.0
