"""needle-twin's error types: library code raises these; cli.py prints them as one red line."""


class NeedleTwinError(Exception):
    """Base class: a problem with the user's input, with the fix in the message."""


class ConfigError(NeedleTwinError, ValueError):
    """A config field is missing, unknown or inconsistent."""


class CheckpointError(NeedleTwinError, ValueError):
    """A checkpoint cannot be read, is unsafe, or does not match the config."""


class GenerationError(NeedleTwinError, ValueError):
    """Generation arguments do not fit the model (token ids, lengths, shapes)."""


class TokenizerError(NeedleTwinError, ValueError):
    """A tokenizer cannot be loaded or does not fit the model."""
