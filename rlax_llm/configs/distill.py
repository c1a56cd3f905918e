"""On-policy distillation: SmolLM2-135M-Instruct as shipped (the student) learns 2-digit
addition from a stronger SmolLM2-135M (the teacher) scoring the student's own samples
(docs/losses.md "On-policy distillation"; issue 63).

The student samples completions of configs/smollm2.py's task; the frozen teacher scores
every sampled token, and the student trains on the per-token reverse-KL advantage
``log pi_teacher - log pi_student`` (rl.distill.kind='reverse_kl', through the GRPO loss's
ratios and clipping), alone (the default) or added to the task's group advantage (variant
``reward``). Every group trains (no dynamic sampling: groups whose rewards are equal still
carry the teacher's dense signal).

The teacher is a checkpoint you pass, a SmolLM2-135M of the same tokenizer:
``--config.teacher.path=DIR`` (an HF directory, a .gguf or a hub id). The benchmark makes
it with the shipped GRPO recipe and the exporter:

    python -m rlax_llm.launch --config=configs/smollm2.py --workdir=runs/teacher
    python -m rlax_llm.export --checkpoint=runs/teacher --out=exports/teacher
    python -m rlax_llm.launch --config=configs/distill.py \
        --config.teacher.path=exports/teacher --workdir=runs/distill

Variants (``--config=configs/distill.py:VARIANT``):
  reward: distillation plus the task reward, A = A_task + rl.distill.weight * A_distill.
  smoke: two steps on a few prompts with the packaged SmolLM2 as its own teacher (checks
    the path end to end; distillation from itself trains nothing but runs everything).
"""

import ml_collections

from rlax_llm.cli import CONFIG_DIR, load_config_file, unknown_variant

VARIANTS = ('reward', 'smoke')


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  c = load_config_file(str(CONFIG_DIR / 'smollm2.py'))
  c.name = 'distill'
  c.rl.distill.update(dict(kind='reverse_kl', weight=1.0, with_reward=False))
  # The student's own model family and tokenizer; teacher.path is the checkpoint you pass.
  c.teacher.update(dict(enabled=True, name='smollm2-135m', dtype='float32', quant='none'))
  # Every group trains: distillation gives a signal whatever the rewards.
  c.rollout.update(dict(oversample=0.0, short_batches='pad'))
  if variant == 'reward':
    c.name = 'distill_reward'
    c.rl.distill.with_reward = True
  elif variant == 'smoke':
    c.name = 'distill_smoke'
    c.total_steps = 2
    c.rl.prompts_per_step = 2
    c.rl.group_size = 4
    c.task.num_eval = 8
    c.sampling.max_new_tokens = 12
    c.eval.every_steps = 0
  elif variant is not None:
    raise unknown_variant(variant, 'configs/distill.py', VARIANTS)
  return c
