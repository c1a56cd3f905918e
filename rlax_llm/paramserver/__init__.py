"""Parameter server: versioned weight snapshots shared by the trainer and inference workers,
lossless sparse deltas between versions, and the two ends every backend uses: the trainer's
``publisher`` and the workers' ``receiver``."""

from rlax_llm.paramserver import delta
from rlax_llm.paramserver.server import (
                                         ParameterServer,
                                         Shard,
                                         ShardPush,
                                         WeightSnapshot,
                                         local_shards,
)

__all__ = ['ParameterServer', 'Shard', 'ShardPush', 'WeightSnapshot', 'delta', 'local_shards']
