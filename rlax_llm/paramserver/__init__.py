"""Parameter server: versioned weight snapshots shared by the trainer and inference workers,
lossless sparse deltas between versions, and the two ends every backend uses: the trainer's
``publisher`` and the workers' ``receiver``."""

from rlax_llm.paramserver import delta
from rlax_llm.paramserver.server import ParameterServer, WeightSnapshot
from rlax_llm.paramserver.shards import Shard, ShardPush, local_shards

__all__ = ['ParameterServer', 'Shard', 'ShardPush', 'WeightSnapshot', 'delta', 'local_shards']
