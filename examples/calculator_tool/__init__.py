"""A multi-turn tool-use example: the model calls a calculator with ``[expression]``."""
