"""Data preparation: the prompt stream the controller consumes and the warm-up's SFT batches.

``prompt_dataset`` is a grain ``MapDataset`` whose element ``s`` holds the prompts of RL step
``s``; its iterator's state is the controller's data position (what a snapshot stores).
``sft_batch`` tokenizes a task's demonstrations with the model's tokenizer into
teacher-forcing rows (``padded_rows``; an environment run's come from
``trainer.warmup.demo_batch``).
"""

from __future__ import annotations

import grain
import numpy as np

from rlax_llm.tasks import Task
from rlax_llm.tokenization import Tokenizer


def prompt_dataset(task: Task, prompts_per_step: int) -> grain.MapDataset:
  """Batches of training prompts: element ``s`` holds the prompts of RL step ``s``."""
  return (grain.MapDataset.range(0, 2**40)
          .map(task.train_prompt)
          .batch(prompts_per_step, batch_fn=list))


def sft_batch(task: Task, tokenizer: Tokenizer, start: int, batch_size: int
              ) -> dict[str, np.ndarray]:
  """Demonstrations ``start .. start + batch_size - 1`` as ``[bos] prompt completion [eos]``
  rows (bos only if the tokenizer's ``add_bos_token`` says so).

  Returns ``tokens`` int32 ``[B, T]`` and ``loss_mask`` float32 ``[B, T]`` (1 on the
  completion and eos tokens, the targets the model must learn to produce).
  """
  rows, masks = [], []
  for i in range(start, start + batch_size):
    prompt, completion = task.sft_example(i)
    p = tokenizer.encode(prompt, add_bos=tokenizer.add_bos_token)
    c = tokenizer.encode(completion, add_eos=True)
    rows.append(p + c)
    masks.append([0.0] * len(p) + [1.0] * len(c))
  return padded_rows(rows, masks, tokenizer.pad_id)


def padded_rows(rows: list[list[int]], masks: list[list[float]], pad_id: int
                ) -> dict[str, np.ndarray]:
  """``rows`` and their loss ``masks`` right-padded to the longest: ``tokens`` int32 [B, T]
  (``pad_id``) and ``loss_mask`` float32 [B, T] (0)."""
  length = max(len(r) for r in rows)
  tokens = np.full((len(rows), length), pad_id, np.int32)
  loss_mask = np.zeros((len(rows), length), np.float32)
  for i, (r, m) in enumerate(zip(rows, masks)):
    tokens[i, :len(r)] = r
    loss_mask[i, :len(m)] = m
  return {'tokens': tokens, 'loss_mask': loss_mask}
