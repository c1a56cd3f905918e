"""Parameter server: versioned weight snapshots shared by the trainer and inference workers,
and lossless sparse deltas between versions."""

from rlax_llm.paramserver import delta
from rlax_llm.paramserver.server import ParameterServer, WeightSnapshot

__all__ = ['ParameterServer', 'WeightSnapshot', 'delta']
