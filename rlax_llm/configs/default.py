"""The embedded default: a tiny decoder learns 2-digit addition, then GRPO improves it.

Runs on a laptop CPU in minutes: a short supervised warm-up on synthetic problems gives the
model partial competence (the RL starting point), then synchronous on-policy GRPO raises its
held-out greedy accuracy. It ships in the package and is the config schema: every config
has its keys (``rlax_llm.config``; docs/config.md).
Variants (``--config=configs/default.py:VARIANT``):
  smoke: a few steps of everything, for tests and for checking an install (seconds). Its
    warm-up and 1-digit task give mixed rewards, so every RL step updates the weights (a
    run whose rewards were all equal would check nothing past the warm-up).
"""

import os

import ml_collections
from ml_collections.config_dict import placeholder

from rlax_llm.cli import unknown_variant

VARIANTS = ('smoke',)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = 'default'
  c.seed = 0
  c.total_steps = 200  # RL updates

  # name: 'tiny' (built from model.tiny with a character tokenizer over the task's charset),
  # a preset ('smollm2-135m', 'qwen3-0.6b', ...; the checkpoint must have its architecture)
  # or 'auto' (the architecture of the checkpoint's config.json), loaded from model.path (an
  # HF directory, a .gguf file or a Hugging Face hub id ORG/NAME; SmolLM2's ships as a pip
  # package) with the checkpoint's tokenizer. revision: of a hub id, a branch, tag or commit
  # sha ('' = the repository's default branch).
  c.model = ml_collections.ConfigDict(dict(
      name='tiny', path=placeholder(str), revision='',
      tiny=ml_collections.ConfigDict(dict(
          num_layers=2, embed_dim=64, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=256,
          rope_theta=10_000.0, tie_embeddings=True)),
      max_seq_len=16,  # None for a checkpoint: its own
      param_dtype='float32', dtype='float32', remat='none',
      # The inference workers' copy of the params: '' (param_dtype) or 'bfloat16' (the
      # trainer keeps param_dtype master weights and pushes a bf16 cast; docs/rollout.md).
      inference_param_dtype='',
      # 'int8': the workers sample with an int8 weight-only copy of each version (per-channel
      # scales, made on the pull; docs/rollout.md "Quantised rollouts (int8)"); 'none': not.
      inference_quant='none',
      # 'int8': the workers' KV cache holds int8 keys and values with a float32 scale per
      # (token, kv head), read dequantised (docs/rollout.md "Quantised rollouts (int8)").
      kv_cache_quant='none',
      batch_invariant=False,  # True: sampler and trainer log-probs bitwise equal (docs/models.md)
      # With batch_invariant: 'chunks' (fastest for engines of up to 32 slots) or 'floor'
      # (no slower than the default numerics for 64 slots or more; needs mesh.*.data == 1).
      invariant_rows='chunks',
      # A mixture of experts: 'r3' (rollout routing replay) records the experts the workers
      # routed every token to and the trainer routes by them (docs/models.md "Rollout
      # routing replay"); 'off': the trainer routes by its own router.
      routing_replay='off',
      # A mixture of experts: how its experts run in the trainer (and the engine, unless
      # inference_moe_impl below says otherwise): '' (Execution's default, 'ragged': grouped
      # matmuls, XLA:TPU's kernel), 'ragged', 'dense' (every expert on every token) or
      # 'blocked' (the routed rows in blocks of one expert: the fastest on XLA:CPU).
      moe_impl='',
      # A mixture of experts: how the workers' engine computes the experts, apart from the
      # trainer (docs/models.md "Experts in the engine"): '' (the trainer's grouped matmul),
      # 'ragged', 'dense' (every expert on every token), 'blocked' (as model.moe_impl) or
      # 'dense_decode' (dense in the decode step only: fewer HBM bytes than the grouped matmul
      # on XLA:TPU by the compiler's model).
      inference_moe_impl='',
  ))
  # LoRA (rlax_llm/models/lora.py, docs/models.md "LoRA"): rank 0 = off (full fine-tuning);
  # rank > 0 trains only low-rank adapters (scale alpha / rank) on the comma-separated targets
  # (of q, k, v, o, gate, up, down) over the frozen base. sync: what the trainer pushes per
  # version, 'adapters' (the adapters alone; the base once, merged by the workers on pull)
  # or 'merged' (the merged weights). base_quant: how the trainer holds the frozen base,
  # 'none' (model.param_dtype) or 'int8' (QLoRA-style: the seven projections int8 with a
  # float32 scale per output channel; workers get it dequantised; needs rank > 0).
  # sync_dtype: the dtype adapter versions travel in with sync='adapters', 'float32' (as
  # trained), 'bfloat16' (half the bytes) or 'int8' (a quarter, plus a float32 scale per rank
  # component); the workers merge the rounded adapters.
  c.lora = ml_collections.ConfigDict(dict(rank=0, alpha=16.0, targets='q,k,v,o,gate,up,down',
                                          sync='adapters', base_quant='none',
                                          sync_dtype='float32'))
  c.task = ml_collections.ConfigDict(dict(
      name='arithmetic', max_operand=99, operations='+', num_eval=200, demo_error_rate=0.6,
      format='plain', answer_format='exact',
  ))
  # Multi-turn agent runs (docs/environments.md, "Training on an environment"): env.name ''
  # trains on the task above; an environment's name (rlax_llm.envs.ENVS) or a class of yours
  # ('module.path:ClassName') trains on its episodes instead, its other fields being the
  # environment's keyword arguments. Each prompt of the stream is then an environment seed
  # played rl.group_size times; rewards are the environment's, rl.advantage_estimator may
  # also be trajectory_grpo, turn_grpo or gigpo. sampling.max_prompt_len bounds the first
  # prompt, sampling.max_new_tokens the rest of the conversation (turns and observations).
  c.env = ml_collections.ConfigDict(dict(name=''))
  # agent: max_turns caps the environment's own (0: its own); max_concurrent_episodes per
  # worker (0: rollout.slots); timeout_s per episode (wall clock); max_turn_tokens per turn
  # (0: sampling.max_new_tokens); held-out evaluation plays num_eval greedy episodes on the
  # seeds eval_seed_start, eval_seed_start + 1, ... (the train stream's seeds lie below).
  c.agent = ml_collections.ConfigDict(dict(
      max_turns=0, max_concurrent_episodes=0, timeout_s=300.0, max_turn_tokens=0,
      num_eval=32, eval_seed_start=2**40))
  # Supervised warm-up that produces the RL starting point (0 steps = start from init).
  # cache: a directory (local or gs://) of finished warm-ups shared by runs; a run whose
  # warm-up (same model, task, warm-up keys, seed, mesh, code and versions) is there restores
  # it instead of training it. Default: $RLAX_LLM_WARMUP_CACHE, '' when unset (no cache;
  # rlax_llm/warmup_cache.py).
  c.warmup = ml_collections.ConfigDict(dict(
      steps=2000, batch_size=64, learning_rate=3e-3, warmup_steps=50,
      cache=os.environ.get('RLAX_LLM_WARMUP_CACHE', ''),
  ))
  # Loss: any name in rlax_llm.losses.LOSSES (docs/losses.md). Placeholders (None) take the
  # named loss's defaults: its advantage estimator, clip range, aggregation, KL estimator.
  c.rl = ml_collections.ConfigDict(dict(
      loss='grpo', group_size=8, prompts_per_step=32, learning_rate=3e-4,
      # The seed of the RL batches' sampling keys alone (None: config.seed). Model init, the
      # warm-up, the prompt stream, the held-out split and evaluation keep config.seed, so
      # runs of one warm-up that differ only in rl.seed measure the RL phase's own noise.
      seed=placeholder(int),
      lr_decay_steps=0,
      max_grad_norm=1.0, weight_decay=0.0,
      max_nonfinite_updates=3,  # consecutive skipped (NaN/Inf) updates before the run stops
      micro_batches=1,  # gradient accumulation: activation memory of batch / micro_batches rows
      logprob_chunk=0,  # > 0: lm head + log-probs this many positions at a time (no [B,T,V])
      shared_prefix=False,  # True: score completions only; each group's prompt runs once
      # A mixture of experts: the weight of the router's load-balancing loss in the trainer's
      # objective (0: off, as in the peers' RL; the checkpoint's router_aux_loss_coef is
      # pre-training's and is not read by RL).
      moe_aux_loss_coef=0.0,
      advantage_estimator=placeholder(str), eps_low=placeholder(float),
      eps_high=placeholder(float), aggregation=placeholder(str),
      kl_beta=0.0, kl_estimator=placeholder(str),
      m2po_tau=0.04, m2po_variant='paper',
      # Multi-turn estimators (env runs; rlax_llm/losses/multi_turn.py): the discount of later
      # turns' rewards, GiGPO's weight of the step-level advantage, F_norm ('std' | 'mean').
      turn_gamma=0.95, turn_omega=1.0, turn_norm='std',
      old_logprobs='behaviour',  # or 'recompute' (decoupled PPO; enables mismatch; not m2po)
      mismatch=ml_collections.ConfigDict(dict(
          enabled=False, level='token', mode='truncate', threshold=2.0,
          veto_threshold=placeholder(float))),
      # On-policy distillation from config.teacher (docs/losses.md "On-policy distillation"):
      # kind 'off', 'reverse_kl' (per-token A = A_task + weight * (log pi_teacher - log
      # pi_student) on the sampled tokens; with_reward=False drops A_task) or 'gkd' (GKD's
      # generalised JSD over the teacher's top_k tokens, beta in [0, 1]: 0 forward KL, 1
      # reverse KL; tail: one more bucket for each side's mass outside the top_k instead of
      # renormalising on it).
      distill=ml_collections.ConfigDict(dict(
          kind='off', beta=0.5, weight=1.0, top_k=0, with_reward=True, tail=False)),
  ))
  # The frozen teacher of on-policy distillation (enabled exactly when rl.distill.kind is not
  # 'off'): name/path/revision as model.* ('tiny': model.tiny's architecture initialised from
  # seed, for tests); it must share the student's tokenizer. dtype: its params' and compute
  # dtype; quant 'int8': its projections held int8 (models/quant.py). It runs in the
  # controller's process on the first device, or on Ray in an actor of its own
  # (docs/architecture.md, the role table).
  c.teacher = ml_collections.ConfigDict(dict(
      enabled=False, name='tiny', path=placeholder(str), revision='', dtype='float32',
      quant='none', seed=1))
  # The policy's sampling transform (rollouts; evaluation is greedy) and lengths in tokens;
  # overlong_prompts: what a file/hub-dataset task's prompt longer than max_prompt_len does,
  # found when the run is prepared: 'error' (refuse the run) or 'drop' (leave it out of the
  # task; rlax_llm/tasks/prompt_length.py). Generated tasks are checked by the worker.
  c.sampling = ml_collections.ConfigDict(dict(
      temperature=1.0, top_k=0, top_p=1.0, max_prompt_len=8, max_new_tokens=5,
      overlong_prompts='error',
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
  # layer_loop: how the workers' engines run the decoder's layers: 'auto' ('unrolled' on CPU
  # devices, 'scan' on accelerators or with model.batch_invariant), 'scan' or 'unrolled'
  # (docs/models.md "The layer loop").
  c.rollout = ml_collections.ConfigDict(dict(
      workers=1, slots=256, on_swap='continue', oversample=0.0,
      short_batches='pad', stop_after_groups=0, replay=0.0,
      worker_timeout_s=600.0, layer_loop='auto'))
  # RLAX staleness: j = inference reload threshold, k = trainer acceptance window.
  # schedule: 'deterministic' (the controller names the version of every batch: reproducible
  # and resumable bit for bit) or 'free' (workers pull the latest version between decode
  # steps whenever it is j or more ahead; k enforced at training time; fresher and not
  # reproducible; needs local.concurrent and no checkpoints; docs/architecture.md).
  c.staleness = ml_collections.ConfigDict(dict(j=1, k=1, schedule='deterministic'))
  # Where roles run: 'local' (this process; local.concurrent: each role on its own thread,
  # False runs every call inline, the synchronous reference) or 'ray' (one actor per role).
  c.backend = 'local'
  c.local = ml_collections.ConfigDict(dict(concurrent=True))
  # ray: 'local' starts a private cluster on loopback; else the address of a running one.
  # Resources each actor asks for, e.g. {'TPU': 4} to put roles on separate TPU hosts;
  # teacher_resources: on-policy distillation's teacher's, e.g. {'TPU': 1} (a chip of its own;
  # needed when the other roles ask for 'TPU').
  # worker_restarts / teacher_restarts: how often Ray restarts a lost worker / teacher actor
  # (its call is retried there).
  # trainer_processes: trainer actors forming one jax.distributed job (one per host of a
  # multi-host trainer slice; each asks for trainer_resources and pushes its own shards);
  # trainer_env: environment variables of each trainer actor's process (e.g. XLA_FLAGS).
  c.ray = ml_collections.ConfigDict(dict(
      address='local', num_cpus=0, trainer_resources=ml_collections.ConfigDict(),
      worker_resources=ml_collections.ConfigDict(), teacher_resources=ml_collections.ConfigDict(),
      worker_restarts=3, teacher_restarts=3, trainer_processes=1,
      trainer_env=ml_collections.ConfigDict()))
  # The parameter server (the trainer pushes each version, workers pull theirs): keep_versions
  # is how many versions it holds, at least staleness.k + 2 (0: exactly k + 2). transport (Ray):
  # 'auto' moves versions between actors of one machine through the server's reused shared-
  # memory slots and between machines through the object store; 'object_store': always that.
  c.paramserver = ml_collections.ConfigDict(dict(keep_versions=0, transport='auto'))
  # Orbax checkpoints in workdir/checkpoints (0 and 0: none): after steps that are multiples
  # of every_steps, and when every_seconds have passed; the newest `keep` are kept. SIGTERM or
  # SIGINT saves one and exits 0; relaunching with the same --workdir resumes. A step that
  # would end past preemption_notice_s seconds after the signal (Cloud TPU: about 30) is
  # abandoned and the state before it saved (0: always finish the step; docs/checkpoints.md).
  c.checkpoint = ml_collections.ConfigDict(dict(
      every_steps=50, every_seconds=600.0, keep=3, async_save=True, preemption_notice_s=30.0))
  # Multi-host JAX (TPU pods): jax.distributed.initialize before anything else. On Cloud TPU
  # the arguments are discovered; elsewhere give coordinator_address, num_processes, process_id.
  c.distributed = ml_collections.ConfigDict(dict(
      initialize=False, coordinator_address=placeholder(str), num_processes=placeholder(int),
      process_id=placeholder(int)))
  # Held-out evaluation every `every_steps` RL steps and at the end: greedy accuracy, and with
  # samples = n > 0 also mean@n and unbiased pass@k (k = 1, 2, 4, ..., n) of n draws per prompt
  # with the rollout sampling transform (rlax_llm/evaluation.py).
  c.eval = ml_collections.ConfigDict(dict(every_steps=50, samples=0))
  # Reward shaping (rlax_llm/rewards.py, docs/tasks.md): named components {weight, kind
  # (default: the name), parameters}; the weighted sum is trained on and each component is
  # logged as reward/<name>. Kinds: task (the verifier), format (the task's format_ok, or
  # pattern=REGEX), overlong (DAPO's soft overlong penalty over the last `cache` tokens of
  # max_length, default sampling.max_new_tokens), function (fn='module.path:name', your
  # reward(prompt, completion) -> float, run in the verifier pool within timeout_s).
  c.reward = ml_collections.ConfigDict(dict(
      task=ml_collections.ConfigDict(dict(weight=1.0))))
  # Axis sizes per role; -1 takes the remaining devices.
  c.mesh = ml_collections.ConfigDict(dict(
      trainer=ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1)),
      inference=ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1)),
      disjoint=False,  # True: the trainer takes the first devices, each worker the next ones
  ))
  # text_every: sampled completions as TensorBoard text (tag 'samples') every N steps; 0 = off.
  c.log = ml_collections.ConfigDict(dict(console_every=1, tensorboard=True, text_every=10))

  if variant == 'smoke':
    c.name = 'default_smoke'
    c.total_steps = 3
    c.warmup.steps = 80  # with 1-digit operands: some samples right, some wrong
    c.warmup.batch_size = 16
    c.task.max_operand = 9
    c.rl.prompts_per_step = 4
    c.rl.group_size = 4
    c.task.num_eval = 16
    c.eval.every_steps = 2
  elif variant is not None:
    raise unknown_variant(variant, 'configs/default.py', VARIANTS)
  return c
