"""User-facing errors.

Anything a user can cause (a bad model name, a prompt that does not fit, an invalid sampling value,
a missing optional package) raises a :class:`DartspecError` with a one-line message that says what
to do. The CLI prints that line and exits non-zero; the server turns it into an HTTP 400.
"""


class DartspecError(Exception):
    """An error caused by user input or the environment, with a message meant for the user."""


class FieldError(DartspecError):
    """A request field that cannot be served (``param`` names it, as the server's 400 does)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownModelError(DartspecError):
    """The model name is neither a known name, a local folder, a GGUF file nor a reachable hub id."""


class ContextLengthError(DartspecError):
    """The prompt (plus room to generate) does not fit the model's context window."""


class MissingPackageError(DartspecError):
    """An optional Python package is needed for this feature."""

    def __init__(self, package: str, extra: str | None = None, purpose: str = "this feature") -> None:
        hint = f"pip install 'dartspec[{extra}]'" if extra else f"pip install {package}"
        super().__init__(f"{purpose} needs the Python package '{package}': install it with `{hint}`")
        self.package = package


def require(module: str, *, package: str | None = None, extra: str | None = None, purpose: str = "") -> object:
    """Import an optional module or raise :class:`MissingPackageError` naming how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingPackageError(package or module, extra, purpose or f"'{module}'") from None
