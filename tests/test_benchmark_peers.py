"""benchmarks/peers (the head-to-head with TRL and Tunix): what is checked in rlax_llm's venv,
without the peers' venvs: the plain reward equals the task's, the job's data is the recipe's,
the settings table lists every setting that differs, and the driver's figures."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'benchmarks' / 'peers'))

import driver  # noqa: E402
import job as job_lib  # noqa: E402
import reward as reward_lib  # noqa: E402

from rlax_llm.roles import build_task  # noqa: E402
from rlax_llm.tokenization import encode_prompts  # noqa: E402


@pytest.fixture(scope='module')
def config():
  return job_lib.recipe_config()


@pytest.fixture(scope='module')
def task(config):
  return build_task(config)


def completions_for(a: int, b: int, answer: str) -> list[str]:
  """Completions of every kind the strict format tells apart, right and wrong."""
  wrong = str(int(answer) + 1)
  return [answer, f' {answer} ', f'{answer}.', f'{a} + {b} = {answer}', f'{a}+{b}={answer}.',
          f'{b} + {a} = {answer}', f'{a} + {b} = {wrong}', wrong, f'-{answer}',
          f'The answer is {answer}.', f'{answer}\n\nDone', '', 'x' * 300, answer + ' ' * 300,
          f'{a} * {b} = {answer}', '٣']


def test_reward_equals_the_task_score_on_the_held_out_set(config, task):
  prompts = task.eval_prompts()
  assert len(prompts) == config.task.num_eval == 100
  checked = 0
  for prompt in prompts:
    a, op, b = job_lib.problem_of(prompt)
    for completion in completions_for(a, b, prompt.answer):
      assert reward_lib.reward(completion, a, op, b, prompt.answer) == task.score(
          prompt, completion), (prompt.text, completion)
      checked += 1
  assert checked == 1600
  a, op, b = job_lib.problem_of(prompts[0])
  assert reward_lib.reward(prompts[0].answer, a, op, b, prompts[0].answer) == 1.0
  assert reward_lib.reward(None, a, op, b, prompts[0].answer) == 0.0


def test_job_rows_are_the_recipes_prompts_as_rlax_llm_renders_them(config, task,
                                                                   smollm2_tokenizer):
  job = job_lib.build_job(config, smollm2_tokenizer, num_train=6)
  train = [task.train_prompt(i) for i in range(6)]
  for rows, prompts in ((job['train'], train), (job['eval'], task.eval_prompts())):
    assert [r['prompt_id'] for r in rows] == [p.prompt_id for p in prompts]
    assert [r['answer'] for r in rows] == [p.answer for p in prompts]
    assert [r['messages'] for r in rows] == [[dict(m) for m in p.messages] for p in prompts]
    assert [f'{r["a"]}{r["op"]}{r["b"]}=' for r in rows] == [p.text for p in prompts]
    assert [r['prompt_ids'] for r in rows] == encode_prompts(smollm2_tokenizer, prompts)
    for row in rows[:3]:
      assert row['prompt'].endswith('<|im_start|>assistant\n')
      assert smollm2_tokenizer.encode(row['prompt']) == row['prompt_ids']
  json.dumps(job)  # plain data for the peers' venvs
  # run_rlax.py trains with task.num_eval=0 (no in-run evaluation): the same train stream,
  # and the held-out split a prefix of the job's.
  config.task.num_eval = 0
  try:
    quiet = build_task(config)
  finally:
    config.task.num_eval = 100
  assert [quiet.train_prompt(i).text for i in range(50)] == [
      task.train_prompt(i).text for i in range(50)]


def test_settings_are_the_recipes_and_the_table_lists_every_difference(config):
  sides = job_lib.side_settings(config)
  ours = sides['rlax_llm']
  assert (ours['group_size'], ours['prompts_per_step'], ours['max_new_tokens'],
          ours['temperature'], ours['learning_rate'], ours['lr_decay_updates'],
          ours['kl_beta'], ours['steps']) == (
              config.rl.group_size, config.rl.prompts_per_step,
              config.sampling.max_new_tokens, config.sampling.temperature,
              config.rl.learning_rate, config.rl.lr_decay_steps, config.rl.kl_beta,
              config.total_steps)
  assert (ours['adam_b1'], ours['adam_b2'], ours['clip_eps_low'], ours['clip_eps_high'],
          ours['aggregation']) == (0.9, 0.99, 0.2, 0.2, 'seq-mean-token-mean')
  assert set(sides) == set(job_lib.SIDES)
  table = job_lib.settings_table(sides)
  listed = {row['setting'] for row in table}
  differing = {key for key in ours for side in sides if sides[side][key] != ours[key]}
  assert listed == differing
  assert {'dynamic_sampling', 'samples_per_step', 'updates'} <= listed
  for row in table:
    for peer, changes in job_lib.PEER_CHANGES.items():
      if row['setting'] in changes:
        assert row['why'][peer]
  markdown = job_lib.format_table(table)
  assert markdown.count('\n') == len(table) + 1


def test_a_peer_change_of_an_unknown_setting_is_refused(config, monkeypatch):
  monkeypatch.setitem(job_lib.PEER_CHANGES['trl'], 'not_a_setting', (1, 'why'))
  with pytest.raises(KeyError, match='not_a_setting'):
    job_lib.side_settings(config)


def test_driver_figures():
  curve = [{'step': 0, 'wall_s': 0.0, 'accuracy': 0.3},
           {'step': 20, 'wall_s': 100.0, 'accuracy': 0.85},
           {'step': 40, 'wall_s': 200.0, 'accuracy': 0.9}]
  hit = driver.time_to(curve, 0.8)
  assert (hit['reached'], hit['wall_s'], hit['step']) == (True, 100.0, 20)
  miss = driver.time_to(curve, 0.95)
  assert (miss['reached'], miss['wall_s'], miss['best']['step']) == (False, None, 40)
  rows = [dict(rollout_s=50.0, train_s=40.0, rollout_tokens=100, train_tokens=1000,
               peak_rss_mb=10.0),
          dict(rollout_s=2.0, train_s=4.0, rollout_tokens=400, train_tokens=2000,
               peak_rss_mb=30.0),
          dict(rollout_s=2.0, train_s=4.0, rollout_tokens=400, train_tokens=2000,
               peak_rss_mb=20.0)]
  got = driver.speeds(rows)
  assert got['rollout_tokens_per_s'] == 200.0  # the first step (compiling) left out
  assert got['train_tokens_per_s'] == 500.0
  assert (got['first_step_s'], got['peak_rss_mb'], got['steps_logged']) == (90.0, 30.0, 3)


def test_driver_per_side_flags():
  sides = ['rlax_llm', 'trl', 'tunix']
  assert driver.per_side('save_every', '5', sides, 20) == {'rlax_llm': 5, 'trl': 5, 'tunix': 5}
  assert driver.per_side('save_every', 'trl=10,tunix=10', sides, 20) == {
      'rlax_llm': 20, 'trl': 10, 'tunix': 10}
  assert driver.per_side('budget_minutes', 'rlax_llm=25,trl=45', sides, None, float) == {
      'rlax_llm': 25.0, 'trl': 45.0, 'tunix': None}
  assert driver.per_side('budget_minutes', '', sides, None, float) == dict.fromkeys(sides)
  assert driver.per_side('budget_minutes', '0.5', ['trl'], None, float) == {'trl': 0.5}
  with pytest.raises(SystemExit, match='torch=3'):
    driver.per_side('save_every', 'torch=3', sides, 20)
  with pytest.raises(SystemExit, match='trl=0'):
    driver.per_side('save_every', 'trl=0', sides, 20)
  with pytest.raises(SystemExit, match="--budget_minutes: 'trl=x'"):
    driver.per_side('budget_minutes', 'trl=x', sides, None, float)
  with pytest.raises(SystemExit, match="--budget_minutes: 'nan'"):
    driver.per_side('budget_minutes', 'nan', sides, None, float)
