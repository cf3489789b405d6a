"""needle-twin's error types: library code raises these; cli.py prints them as one red line."""


def one_line(e: BaseException, limit: int = 200) -> str:
    """A foreign exception's message on one line, cut to `limit` characters (to quote inside ours)."""
    return " ".join(str(e).split())[:limit]


class NeedleTwinError(Exception):
    """Base class: a problem with the user's input, with the fix in the message."""


class ConfigError(NeedleTwinError, ValueError):
    """A config field is missing, unknown or inconsistent."""


class ConfigMismatchError(ConfigError):
    """A config given for a checkpoint contradicts the one it carries; `fields`: {name: (stored, given)}."""

    def __init__(self, message: str, fields: dict) -> None:
        super().__init__(message)
        self.fields = fields


class CheckpointError(NeedleTwinError, ValueError):
    """A checkpoint cannot be read, is unsafe, or does not match the config."""


class GenerationError(NeedleTwinError, ValueError):
    """Generation arguments do not fit the model (token ids, lengths, shapes)."""


class TokenizerError(NeedleTwinError, ValueError):
    """A tokenizer cannot be loaded or does not fit the model."""
