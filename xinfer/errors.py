"""Error types shared by every component; each maps to a clear user-facing message."""


class XinferError(Exception):
    """Base class of errors xinfer reports to users."""


class ModelLoadError(XinferError):
    """The model could not be found or read (missing files, corrupt weights, unknown architecture)."""


class InvalidRequestError(XinferError, ValueError):
    """A request or sampling parameter is invalid (maps to HTTP 400; `param` and `code` go in its body)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
