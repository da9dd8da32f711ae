"""User-facing errors. Each carries a message that names the file, field or value at fault.

The CLI prints `error: <message>` and exits non-zero for any FluxionError; the server maps them to 4xx JSON.
"""


class FluxionError(Exception):
    """Base class: something the user can fix; the message says what."""


class ModelFileError(FluxionError):
    """A GGUF file is unreadable, truncated, or uses an unsupported architecture/tensor type."""


class UnknownModelError(FluxionError):
    """A model name is neither in the catalog nor a path to an existing .gguf file."""


class DownloadError(FluxionError):
    """Fetching or assembling a catalog model failed (network, size or sha256 mismatch)."""


class RequestError(FluxionError):
    """A generation request is invalid: empty prompt, bad sampling values, too long for the context."""


class CapacityError(FluxionError):
    """A request does not fit in the configured KV memory or batch limits."""


class SettingError(RequestError, ValueError):
    """A setting (a FLUXION_* variable, a --set flag; fluxion_lite.settings) or a backend option holds a value the
    engine does not know; the message names it and the values it takes. Also a RequestError, as the switches read
    while building an engine raised before the settings object existed, and a ValueError, as the backend's other
    bad-argument errors are."""
