"""Multi-turn environments and the tools their agents call (docs/environments.md)."""
