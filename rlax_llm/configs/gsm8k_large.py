"""GRPO on GSM8K at 8B, 32B and 30B-A3B (Qwen3-8B, Qwen3-32B, the mixture of experts
Qwen3-30B-A3B), trainer and inference on separate slices.

configs/gsm8k.py's recipe (32 questions x 8 samples per update, 384 prompt + 640 completion
tokens, the math scorer, float32 master weights and AdamW state, bfloat16 compute and worker
copies, remat 'full', 8 micro-batches, log-probs 128 positions at a time) on models that do
not fit one host: the variant is the model's hub name (``--config=configs/gsm8k_large.py:
VARIANT``), and ``SLICES[VARIANT]`` the slices it is sized for, on the Ray backend (the
trainer spans every host of its slice in one ``jax.distributed`` job; each inference worker
is one host):

  Qwen3-8B (the default): trainer v5p-16 (8 chips on 2 hosts, fsdp 8), inference v5e-8
    (data 2 x tensor 4 per worker);
  Qwen3-32B: trainer v5p-64 (32 chips on 8 hosts, fsdp 32), inference v5p-8 (tensor 4);
  Qwen3-30B-A3B: trainer v5p-32 (16 chips on 4 hosts, data 4 x fsdp 4: the 128 experts of
    each layer split over data, expert parallelism, and each expert's matrices over fsdp, so
    the experts' weights, gradients and AdamW state are 16-way and the rest 4-way),
    inference v5p-8 (tensor 4: heads and each expert's width over the 4 chips), whose engine
    computes the experts densely in its decode step (``model.inference_moe_impl=
    'dense_decode'``; prefill and the trainer keep the grouped matmul): compiled for v5p-8,
    the decode step reads 114.6 GB/chip against 129.8 (41.5 ms against 46.9 by the
    compiler's model) and holds 20.5 GiB/chip against 20.7 (benchmarks/RESULTS.md, "The
    engine's experts apart from the trainer's"; docs/models.md, "Experts in the engine").

Check and compile before booking the slices (docs/own_model_and_data.md, "Before you book a
TPU")::

  python -m launch.recipes compile --config=configs/gsm8k_large.py:Qwen3-8B \\
      --trainer-tpu-type=v5p-16 --inference-tpu-type=v5e-8
"""

import ml_collections

from rlax_llm.cli import CONFIG_DIR, load_config_file, variant_entry

# Hub name -> (preset in rlax_llm.models.presets, hub repo id, inference tensor parallelism).
MODELS = {
    'Qwen3-8B': ('qwen3-8b', 'Qwen/Qwen3-8B', 4),
    'Qwen3-32B': ('qwen3-32b', 'Qwen/Qwen3-32B', 4),
    'Qwen3-30B-A3B': ('qwen3-30b-a3b', 'Qwen/Qwen3-30B-A3B', 4),
}
VARIANTS = tuple(MODELS)
# Hub name -> (trainer slice, inference slice): python -m launch.recipes ray / compile.
SLICES = {
    'Qwen3-8B': ('v5p-16', 'v5e-8'),
    'Qwen3-32B': ('v5p-64', 'v5p-8'),
    'Qwen3-30B-A3B': ('v5p-32', 'v5p-8'),
}
# Hub name -> the trainer's data axis (default 1: fsdp over every chip). A mixture of experts
# splits its experts over data (``sharding.LOGICAL_RULES``: expert -> data) and the rest of
# each weight over fsdp.
TRAINER_DATA = {'Qwen3-30B-A3B': 4}
# Hub name -> model.inference_moe_impl (default '': the trainer's grouped matmul).
INFERENCE_MOE_IMPL = {'Qwen3-30B-A3B': 'dense_decode'}


def get_config(variant: str | None = None) -> ml_collections.ConfigDict:
  preset, repo, tensor = variant_entry(variant, MODELS, 'configs/gsm8k_large.py')
  # configs/gsm8k.py's recipe (its default variant); what differs follows.
  c = load_config_file(str(CONFIG_DIR / 'gsm8k.py'))
  c.name = f'gsm8k_{preset}'
  c.backend = 'ray'
  c.model.update(dict(name=preset, path=repo,
                      inference_moe_impl=INFERENCE_MOE_IMPL.get(variant or VARIANTS[0], '')))
  c.mesh.trainer.update(dict(data=TRAINER_DATA.get(variant or VARIANTS[0], 1), fsdp=-1,
                            tensor=1))
  c.mesh.inference.update(dict(data=-1, fsdp=1, tensor=tensor))
  return c
