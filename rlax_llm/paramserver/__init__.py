"""Parameter server: versioned weight snapshots shared by the trainer and inference workers."""

from rlax_llm.paramserver.server import ParameterServer, WeightSnapshot

__all__ = ["ParameterServer", "WeightSnapshot"]
