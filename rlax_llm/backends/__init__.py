"""Backends place the roles and move bytes between them; the controller code is the same.

``local``: every role in this process (``rlax_llm.backends.local``).
"""
