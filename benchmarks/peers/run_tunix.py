r"""The head-to-head's Tunix side: the job (benchmarks/peers/job.py) with Tunix's GRPO learner.

Runs in benchmarks/peers/.venv-tunix (setup.sh: google-tunix 0.1.7 on jax 0.10.2):

    benchmarks/peers/.venv-tunix/bin/python benchmarks/peers/run_tunix.py --job=JOB.json \
        --run_dir=DIR [--steps=N] [--save_every=K]

Tunix's model classes are per family; SmolLM2-135M is a Llama (rotate-half RoPE without
Llama-3's frequency scaling, tied embeddings), which Tunix 0.1.7's ``models.llama3`` builds
from a ``ModelConfig`` of its shape (``model_config``: read from the export's config.json)
and loads from the job's Hugging Face export (``create_model_from_safe_tensors``). The
learner is ``GRPOLearner`` on an ``RLCluster`` with the vanilla (JAX) sampler, actor and
sampler sharing one mesh of this machine's device; the optimizer is rlax_llm's exactly
(``optax.chain(clip_by_global_norm, adamw)`` over ``cosine_decay_schedule(alpha=0.1)``). The
reward is benchmarks/peers/reward.py. Every ``save_every`` steps and at the last, the actor's
weights are written back as a Hugging Face directory (``save_hf``: the loader's mapping
inverted; config and tokenizer files copied from the export). The log
(benchmarks/peers/common.py) times the sampler (``RLCluster.generate``) and the rest of each
global step (log-probs, advantages, the update).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import common  # noqa: E402  (plain Python, shared by the sides)
import reward as reward_lib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import safetensors.numpy  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.llama3 import model as llama3  # noqa: E402
from tunix.models.llama3 import params as llama3_params  # noqa: E402
from tunix.rl import rl_cluster as rl_cluster_lib  # noqa: E402
from tunix.rl.grpo import grpo_learner  # noqa: E402
from tunix.rl.rollout import base_rollout  # noqa: E402

TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json',
                   'config.json', 'generation_config.json')


def model_config(model_dir: str) -> llama3.ModelConfig:
  """Tunix's Llama ``ModelConfig`` of the Hugging Face checkpoint in ``model_dir``; raises
  for a checkpoint this family cannot hold (RoPE scaling, biases, untied head sizes)."""
  hf = json.loads((pathlib.Path(model_dir) / 'config.json').read_text())
  rope = hf.get('rope_parameters') or hf.get('rope_scaling') or {}
  if rope.get('rope_type', 'default') != 'default' or hf.get('attention_bias'):
    raise SystemExit(f'{model_dir}: RoPE {rope} / attention_bias={hf.get("attention_bias")}: '
                     'Tunix\'s llama3 model has plain RoPE and no biases.')
  return llama3.ModelConfig(
      num_layers=hf['num_hidden_layers'], vocab_size=hf['vocab_size'],
      embed_dim=hf['hidden_size'], hidden_dim=hf['intermediate_size'],
      num_heads=hf['num_attention_heads'],
      head_dim=hf.get('head_dim') or hf['hidden_size'] // hf['num_attention_heads'],
      num_kv_heads=hf['num_key_value_heads'], rope_theta=int(hf['rope_theta']),
      norm_eps=hf['rms_norm_eps'], weight_tying=bool(hf.get('tie_word_embeddings')))


def hf_tensors(model: llama3.Llama3, config: llama3.ModelConfig) -> dict[str, np.ndarray]:
  """The model's weights under Hugging Face Llama names and layouts: the inverse of
  ``tunix.models.llama3.params``' mapping (projections ``[out, in]``)."""
  state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  out = {'model.embed_tokens.weight': state['embedder']['input_embedding'],
         'model.norm.weight': state['final_norm']['w']}
  e = config.embed_dim
  for i, layer in state['layers'].items():
    p = f'model.layers.{i}.'
    attn, mlp = layer['attn'], layer['mlp']
    for name in ('q', 'k', 'v'):
      out[p + f'self_attn.{name}_proj.weight'] = attn[f'{name}_proj']['w'].reshape(e, -1).T
    out[p + 'self_attn.o_proj.weight'] = attn['o_proj']['w'].reshape(-1, e).T
    for name in ('gate', 'up', 'down'):
      out[p + f'mlp.{name}_proj.weight'] = mlp[f'{name}_proj']['kernel'].T
    out[p + 'input_layernorm.weight'] = layer['input_layernorm']['w']
    out[p + 'post_attention_layernorm.weight'] = layer['post_attention_layernorm']['w']
  if not config.weight_tying:
    out['lm_head.weight'] = state['lm_head']['w'].T
  return {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in out.items()}


def save_hf(model, config, model_dir: str, out: pathlib.Path) -> None:
  """The actor as a Hugging Face directory: its weights (``hf_tensors``) and the export's
  config and tokenizer files."""
  out.mkdir(parents=True, exist_ok=True)
  safetensors.numpy.save_file(hf_tensors(model, config), str(out / 'model.safetensors'),
                              metadata={'format': 'pt'})
  for name in TOKENIZER_FILES:
    if (pathlib.Path(model_dir) / name).exists():
      shutil.copy(pathlib.Path(model_dir) / name, out / name)


def reward_fn(prompts, completions, a, op, b, answer, **_):
  """Tunix's reward-function signature over benchmarks/peers/reward.py."""
  del prompts
  return [reward_lib.reward(c, x, o, y, ans) for c, x, o, y, ans in zip(completions, a, op, b,
                                                                          answer)]


def check_tokenizer(tokenizer, rows) -> None:
  """Raises unless Tunix's sampler ids of each rendered prompt (``Sampler.tokenize``: encode,
  then bos prepended and deduplicated) are rlax_llm's ``prompt_ids``."""
  bos = tokenizer.bos_token_id
  for row in rows:
    ids = tokenizer.encode(row['prompt'])
    ids = ([bos] if bos is not None and ids[:1] != [bos] else []) + ids
    if ids != row['prompt_ids']:
      raise SystemExit(f'Tunix tokenises prompt {row["prompt_id"]} as {ids[:8]}..., rlax_llm '
                       f'as {row["prompt_ids"][:8]}...: the sides would not see the same '
                       'prompts.')


def batches(rows, per_step: int):
  """The train rows as Tunix's input batches (numpy arrays, as a grain dataset yields them:
  the learner repeats each leaf ``group_size`` times): ``prompts`` and the reward's fields."""
  for start in range(0, len(rows) - per_step + 1, per_step):
    chunk = rows[start:start + per_step]
    yield {'prompts': np.asarray([r['prompt'] for r in chunk]), **{
        key: np.asarray([r[key] for r in chunk]) for key in ('a', 'op', 'b', 'answer')}}


class Timed(grpo_learner.GRPOLearner):
  """GRPOLearner whose global steps are timed into the run log (sampling: the cluster's
  ``generate``; the rest: log-probs, advantages, the update), and which writes Hugging Face
  checkpoints after the steps in ``save_at``."""

  def __init__(self, *args, run_log, save_at, save, seed, **kwargs):
    super().__init__(*args, **kwargs)
    rollout_config = self.rl_cluster.get_rollout_config(mode=rl_cluster_lib.Mode.TRAIN)
    self.run_log, self.save_at, self.save = run_log, set(save_at), save
    self._sampled = [0.0, 0]
    self._rewards = []
    generate = self.rl_cluster.generate

    def timed_generate(*a, **k):
      # A fresh sampling seed per step (Tunix's sampler would reuse one key every step:
      # PRNGKey(0) when unset; a key array it donates on the first call).
      rollout_config.seed = seed * 1_000_003 + self.rl_cluster.actor_trainer.train_steps
      start = time.perf_counter()
      out = generate(*a, **k)
      self._sampled[0] += time.perf_counter() - start
      self._sampled[1] += sum(len(t) for t in out.tokens)
      self._prompt_tokens = sum(int(np.sum(np.asarray(p) != self.rl_cluster.rollout.pad_id()))
                                for p in out.left_padded_prompt_tokens)
      return out
    self.rl_cluster.generate = timed_generate

  def _compute_rewards(self, *args, **kwargs):
    rewards = super()._compute_rewards(*args, **kwargs)
    self._rewards.extend(np.asarray(rewards).ravel().tolist())
    return rewards

  def _run_global_step(self, *args, **kwargs):
    start = time.perf_counter()
    self._sampled, self._rewards, self._prompt_tokens = [0.0, 0], [], 0
    out = super()._run_global_step(*args, **kwargs)
    step_s = time.perf_counter() - start
    step = self.rl_cluster.actor_trainer.train_steps
    self.run_log.step(step, rollout_s=self._sampled[0],
                      train_s=max(0.0, step_s - self._sampled[0]),
                      rollout_tokens=self._sampled[1],
                      train_tokens=self._sampled[1] + self._prompt_tokens,
                      reward_mean=float(np.mean(self._rewards)) if self._rewards else float('nan'))
    if step in self.save_at:
      self.save_at.discard(step)
      wall = common.wall_s()
      self.run_log.checkpoint(step, self.save(step), wall)
    return out


def main() -> None:
  args, job, s, steps, rows = common.side_run('tunix', __doc__.split('\n')[0])
  per_step = s['prompts_per_step']
  import importlib.metadata as md  # pylint: disable=import-outside-toplevel
  run_log = common.RunLog(args.run_dir, 'tunix', {
      'google-tunix': md.version('google-tunix'), 'jax': jax.__version__,
      'flax': md.version('flax'), 'optax': optax.__version__}, s)

  model_dir = job['model_dir']
  tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
  check_tokenizer(tokenizer, rows + job['eval_rows'])
  config = model_config(model_dir)
  # One device, Auto axes (jax.make_mesh's default Explicit axes reject Tunix's gathers).
  mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ('fsdp', 'tp'))
  dtype = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}[s['param_dtype']]
  model = llama3_params.create_model_from_safe_tensors(model_dir, config, mesh, dtype=dtype)

  schedule = (optax.cosine_decay_schedule(s['learning_rate'], s['lr_decay_updates'], alpha=0.1)
              if s['lr_decay_updates'] else s['learning_rate'])
  optimizer = optax.chain(
      optax.clip_by_global_norm(s['max_grad_norm']),
      optax.adamw(schedule, b1=s['adam_b1'], b2=s['adam_b2'], eps=s['adam_eps'],
                  weight_decay=s['weight_decay']))
  eos = tokenizer.eos_token_id
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                    rl_cluster_lib.Role.ROLLOUT: mesh},
      rollout_engine='vanilla', offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=steps,
          metrics_logging_options=None, checkpoint_root_directory=None,
          pbar_description=None),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=s['max_new_tokens'], max_prompt_length=s['max_prompt_len'],
          kv_cache_size=s['max_prompt_len'] + s['max_new_tokens'],
          temperature=s['temperature'], top_p=s['top_p'], top_k=s['top_k'] or None,
          eos_tokens=[eos], data_type=dtype))
  cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=tokenizer,
                                     cluster_config=cluster_config)
  if s['clip_eps_low'] != s['clip_eps_high']:  # GRPOConfig has one epsilon
    raise SystemExit(f'Tunix\'s GRPOConfig clips symmetrically; the job asks for '
                     f'[{s["clip_eps_low"]}, {s["clip_eps_high"]}].')
  algo = grpo_learner.GRPOConfig(
      num_generations=s['group_size'], num_iterations=s['updates_per_batch'],
      beta=s['kl_beta'], epsilon=s['clip_eps_low'], loss_agg_mode='sequence-mean-token-mean')

  def save(step: int) -> pathlib.Path:
    out = pathlib.Path(args.run_dir) / f'checkpoint-{step}'
    save_hf(cluster.actor_trainer.model, config, model_dir, out)
    return out

  learner = Timed(cluster, algo, reward_fn, run_log=run_log,
                  save_at=common.save_steps(steps, args.save_every), save=save, seed=s['seed'])
  learner.train(batches(rows, per_step))
  print(f'tunix: {steps} steps in {common.wall_s():.0f} s; log in {args.run_dir}')


if __name__ == '__main__':
  main()
