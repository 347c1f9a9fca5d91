"""The megatron-core training backend (``trainer.backend: megatron``).

Import-light: megatron-core itself is imported inside the functions that need it.
"""
