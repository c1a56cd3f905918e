r"""The head-to-head's TRL side: the job (benchmarks/peers/job.py) with TRL's ``GRPOTrainer``.

Runs in benchmarks/peers/.venv-trl (setup.sh: trl 1.16.0, torch 2.13.0 CPU):

    benchmarks/peers/.venv-trl/bin/python benchmarks/peers/run_trl.py --job=JOB.json \
        --run_dir=DIR [--steps=N] [--save_every=K]

Starts from the job's exported model, trains on its train rows in order with its settings
(``job['sides']['trl']``): ``prompts_per_step`` x ``group_size`` completions per update,
the same AdamW (betas, eps, no weight decay), the same cosine learning-rate schedule (a
``LambdaLR`` restating optax's ``cosine_decay_schedule(alpha=0.1)``), clip range, KL
coefficient, gradient clipping and TRL's ``loss_type='grpo'`` (sequence mean of token means,
as rlax_llm's GRPO). The reward is benchmarks/peers/reward.py. ``Trainer`` saves Hugging Face
checkpoints (model only) every ``save_every`` steps and at the last; the log
(benchmarks/peers/common.py) times TRL's sampling (``_generate_and_score_completions``, the
generation and scoring of a step's completions) and the rest of the step (its update).
"""

from __future__ import annotations

import math
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402  (plain Python, shared by the sides)
import reward as reward_lib  # noqa: E402

import datasets  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402


def cosine_lambda(decay_updates: int, alpha: float = 0.1):
  """optax.cosine_decay_schedule(1, decay_updates, alpha)'s multiplier of update ``i``
  (constant 1 for ``decay_updates == 0``): rlax_llm's ``learning_rate_schedule``."""
  def factor(i: int) -> float:
    if decay_updates <= 0:
      return 1.0
    t = min(i, decay_updates) / decay_updates
    return (1 - alpha) * 0.5 * (1 + math.cos(math.pi * t)) + alpha
  return factor


def reward_func(completions, a, op, b, answer, **_):
  """TRL's reward-function signature over benchmarks/peers/reward.py."""
  return [reward_lib.reward(c, x, o, y, ans) for c, x, o, y, ans in zip(completions, a, op, b,
                                                                          answer)]


def check_tokenizer(tokenizer, rows) -> None:
  """Raises unless TRL's tokenisation of each rendered prompt (``tokenizer(text=...)``, what
  GRPOTrainer does with a string prompt) is rlax_llm's ``prompt_ids``."""
  got = tokenizer(text=[r['prompt'] for r in rows])['input_ids']
  for row, ids in zip(rows, got):
    if list(ids) != row['prompt_ids']:
      raise SystemExit(f'TRL tokenises prompt {row["prompt_id"]} as {list(ids)[:8]}..., '
                       f'rlax_llm as {row["prompt_ids"][:8]}...: the sides would not see the '
                       'same prompts; re-export the job (job.py).')


class Timed(trl.GRPOTrainer):
  """GRPOTrainer whose steps are timed into the run log: sampling (generation and scoring)
  and the rest of the step (the update)."""

  def __init__(self, *args, run_log: common.RunLog, **kwargs):
    super().__init__(*args, **kwargs)
    self.run_log = run_log
    self._rollout = (0.0, 0, 0, 0.0)

  def _generate_and_score_completions(self, inputs):
    start = time.perf_counter()
    out = super()._generate_and_score_completions(inputs)
    tokens = int(out['completion_mask'].sum())
    trained = tokens + int(out['prompt_mask'].sum())
    rewards = self._metrics['train'].get('reward', [float('nan')])
    self._rollout = (time.perf_counter() - start, tokens, trained, float(rewards[-1]))
    return out

  def optimizer_step_logged(self, step_s: float) -> None:
    rollout_s, tokens, trained, reward = self._rollout
    self.run_log.step(self.state.global_step, rollout_s=rollout_s,
                      train_s=max(0.0, step_s - rollout_s), rollout_tokens=tokens,
                      train_tokens=trained, reward_mean=reward)


class LogCallback(transformers.TrainerCallback):
  """Writes each step's record and each saved checkpoint into the run log."""

  def __init__(self):
    self.trainer = None
    self._begin = 0.0

  def on_step_begin(self, args, state, control, **kwargs):
    self._begin = time.perf_counter()

  def on_step_end(self, args, state, control, **kwargs):
    self.trainer.optimizer_step_logged(time.perf_counter() - self._begin)

  def on_save(self, args, state, control, **kwargs):
    path = pathlib.Path(args.output_dir) / f'checkpoint-{state.global_step}'
    self.trainer.run_log.checkpoint(state.global_step, path)


def main() -> None:
  args, job, s, steps, rows = common.side_run('trl', __doc__.split('\n')[0])
  per_step = s['prompts_per_step']
  run_log = common.RunLog(args.run_dir, 'trl', {
      'trl': trl.__version__, 'torch': torch.__version__,
      'transformers': transformers.__version__, 'datasets': datasets.__version__}, s)

  model_dir = job['model_dir']
  dtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16}[s['param_dtype']]
  model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
  check_tokenizer(tokenizer, rows + job['eval_rows'])
  dataset = datasets.Dataset.from_list([
      {'prompt': r['prompt'], 'a': r['a'], 'op': r['op'], 'b': r['b'], 'answer': r['answer']}
      for r in rows])
  batch = per_step * s['group_size']
  config = trl.GRPOConfig(
      output_dir=args.run_dir, max_steps=steps, seed=s['seed'], use_cpu=True, bf16=False,
      gradient_checkpointing=s['remat'] != 'none',
      per_device_train_batch_size=batch, gradient_accumulation_steps=1, steps_per_generation=1,
      num_generations=s['group_size'], num_iterations=s['updates_per_batch'],
      max_completion_length=s['max_new_tokens'], temperature=s['temperature'],
      top_p=s['top_p'], top_k=s['top_k'], shuffle_dataset=False,
      learning_rate=s['learning_rate'], adam_beta1=s['adam_b1'], adam_beta2=s['adam_b2'],
      adam_epsilon=s['adam_eps'], weight_decay=s['weight_decay'],
      max_grad_norm=s['max_grad_norm'], beta=s['kl_beta'], epsilon=s['clip_eps_low'],
      epsilon_high=s['clip_eps_high'], loss_type='grpo', scale_rewards='group',
      save_strategy='steps', save_steps=args.save_every, save_only_model=True,
      logging_steps=1, report_to='none', dataloader_num_workers=0, disable_tqdm=True)
  optimizer = torch.optim.AdamW(model.parameters(), lr=s['learning_rate'],
                                betas=(s['adam_b1'], s['adam_b2']), eps=s['adam_eps'],
                                weight_decay=s['weight_decay'])
  schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_lambda(s['lr_decay_updates']))
  callback = LogCallback()
  trainer = Timed(model=model, reward_funcs=reward_func, args=config, train_dataset=dataset,
                  processing_class=tokenizer, optimizers=(optimizer, schedule),
                  callbacks=[callback], run_log=run_log)
  callback.trainer = trainer
  trainer.train()
  if steps % args.save_every:  # Trainer saves the last step only on a save_steps multiple
    path = pathlib.Path(args.run_dir) / f'checkpoint-{steps}'
    trainer.save_model(str(path))
    tokenizer.save_pretrained(str(path))
    run_log.checkpoint(steps, path)
  print(f'trl: {steps} steps in {common.wall_s():.0f} s; log in {args.run_dir}')


if __name__ == '__main__':
  main()
