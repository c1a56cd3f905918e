"""rlax_llm: parameter-server RL for post-training LLMs in JAX."""
