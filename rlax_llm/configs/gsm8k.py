"""GRPO on GSM8K from a hub model, sized for Cloud TPU: Qwen2.5, Qwen3 and Llama 3.2 (0.5-2B).

The variant is the model's Hugging Face hub name (``--config=configs/gsm8k.py:VARIANT``);
the checkpoint and the dataset (``openai/gsm8k``, config ``main``: train split to train on,
test split held out) are read from the hub by name:
  Qwen2.5-0.5B-Instruct (the default), Qwen2.5-1.5B-Instruct, Qwen3-0.6B, Qwen3-1.7B,
  Llama-3.2-1B-Instruct (gated: accept its licence on the hub and set HF_TOKEN).
The recipe: 32 questions x 8 samples per update (256 rows of up to 384 prompt + 640
completion tokens), one epoch of GSM8K's 7473 questions (233 updates), the reward the math
scorer's (the final answer after ``####`` or in the last ``\\boxed{}``, docs/tasks.md).
Numerics: float32 master params and AdamW state in the trainer; the inference workers hold a
bfloat16 copy (``model.inference_param_dtype``: the trainer pushes the bf16 cast of each
version, which the parameter server moves and checks; the behaviour log-probs are the bf16
policy's, the trainer's recompute float32's, and the ``mismatch/*`` metrics measure the gap,
docs/rollout.md); bfloat16 compute, activations and KV cache; each block recomputed in the
backward pass (remat 'full'), the batch in 8 micro-batches, log-probs 128 positions at a
time.
Meshes: the trainer shards params, gradients and AdamW state over every chip (fsdp = -1);
each host's inference worker splits heads over 2 chips (Qwen2.5) or 4 (Qwen3, Llama 3.2)
(tensor) and its KV-cache slots over the host's other chips (data = -1). So one config fits
every slice of the recipes' table: on v5e-8 the worker mesh is data 4 x tensor 2 (Qwen2.5)
or data 2 x tensor 4 (the others), on v4-8 and v5p-8 (4 chips) data 2 x tensor 2 or data 1 x
tensor 4, on a multi-host slice every host runs such a worker while the trainer spans all
hosts. Every variant fits v5e-8, v4-8, v5p-8, v6e-8 and the multi-host slices; v5e-4 holds
only the three smaller models. ``python -m launch.recipes tpu-vm --tpu-type=v5e-8 ...
--dry-run`` prints the memory plan per chip (params, AdamW state, gradients, activations, the workers' params and KV cache)
against the chip's HBM (docs/models.md).
"""

import ml_collections
from ml_collections.config_dict import placeholder

from rlax_llm.cli import DEFAULT_CONFIG_PATH, load_config_file, task_section, variant_entry

# Hub name -> (preset in rlax_llm.models.presets, hub repo id, inference tensor parallelism:
# a divisor of the model's heads and kv heads where it can be).
MODELS = {
    'Qwen2.5-0.5B-Instruct': ('qwen2.5-0.5b', 'Qwen/Qwen2.5-0.5B-Instruct', 2),
    'Qwen2.5-1.5B-Instruct': ('qwen2.5-1.5b', 'Qwen/Qwen2.5-1.5B-Instruct', 2),
    'Qwen3-0.6B': ('qwen3-0.6b', 'Qwen/Qwen3-0.6B', 4),
    'Qwen3-1.7B': ('qwen3-1.7b', 'Qwen/Qwen3-1.7B', 4),
    'Llama-3.2-1B-Instruct': ('llama-3.2-1b', 'meta-llama/Llama-3.2-1B-Instruct', 4),
}
VARIANTS = tuple(MODELS)


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  preset, repo, tensor = variant_entry(variant, MODELS, 'configs/gsm8k.py')
  # The packaged default config (the schema, with every key's meaning); what differs follows.
  c = load_config_file(str(DEFAULT_CONFIG_PATH))
  c.name = f'gsm8k_{preset}'
  c.total_steps = 233  # one epoch: 7473 train questions / 32 per update

  c.model = ml_collections.ConfigDict(dict(
      name=preset, path=repo, revision='',  # a hub repo id (revision '': its main branch)
      max_seq_len=placeholder(int),
      # float32 master weights and AdamW state in the trainer; the workers hold a bfloat16
      # copy, which the trainer pushes (half the bytes, sparse deltas between versions).
      param_dtype='float32', inference_param_dtype='bfloat16', inference_quant='none',
      kv_cache_quant='none', dtype='bfloat16', remat='full',
      batch_invariant=False, invariant_rows='chunks', routing_replay='off',
      moe_impl='', inference_moe_impl='',  # a mixture of experts: configs/gsm8k_large.py
  ))
  # Every argument of MathTask at its default (task_section) but these: GSM8K from the hub,
  # 200 of its test split held out, asked in a chat turn, scored by the math scorer.
  c.task = task_section('math', path='hf://datasets/openai/gsm8k', hf_config='main',
                        split='train', eval_split='test', question_field='question',
                        answer_field='answer', num_eval=200, format='chat', scorer='math')
  c.warmup.steps = 0
  c.rl.update(dict(prompts_per_step=32, group_size=8, learning_rate=1e-6, lr_decay_steps=0,
                   micro_batches=8, logprob_chunk=128))
  c.sampling.update(dict(temperature=1.0, max_prompt_len=384, max_new_tokens=640))
  c.rollout.update(dict(workers=1, slots=256))
  c.checkpoint.update(dict(every_steps=25, keep=2))
  c.eval.every_steps = 25
  c.log.text_every = 25
  c.mesh.trainer.update(dict(data=1, fsdp=-1, tensor=1))
  c.mesh.inference.update(dict(data=-1, fsdp=1, tensor=tensor))
  return c
