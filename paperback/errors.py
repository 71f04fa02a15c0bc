"""User-facing errors.

Anything a user can cause (a bad file, an unknown name, a prompt that does not
fit) raises a subclass of `PaperbackError`; the CLI prints its message on one
line and exits non-zero. Any other exception is a bug and keeps its traceback.
"""


class PaperbackError(Exception):
    """An error caused by input, with a message meant for the user."""


class ModelFileError(PaperbackError):
    """A model file is missing, truncated, corrupt or inconsistent."""


class UnsupportedModelError(PaperbackError):
    """The model's architecture or a feature of it is not implemented."""


class ContextLengthError(PaperbackError):
    """A prompt (plus the tokens to generate) does not fit in the context."""


class DatasetError(PaperbackError):
    """An unknown data set name, or a text too short for the request."""
