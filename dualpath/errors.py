"""Typed exceptions shared across dualpath components."""


class DualPathError(Exception):
    """Base class of every error dualpath raises on purpose."""


class ModelSpecError(DualPathError):
    """A model config is missing a field or describes an unsupported architecture."""


class ModelLoadError(DualPathError):
    """Weights or tokenizer files are missing, incomplete or do not match the config."""


class OutOfBlocksError(DualPathError):
    """The paged KV cache has no free block left for an allocation."""


class RequestError(DualPathError):
    """A request is malformed (bad sampling parameters, prompt too long, ...)."""


class StorageError(DualPathError):
    """A KV storage backend failed in a way the caller must hear about."""


class InvalidKeyError(StorageError):
    """A block key is malformed or would name a path outside the store."""


class HostPoolExhaustedError(DualPathError):
    """The host DRAM buffer has no free slot for a request."""


class TransferError(DualPathError):
    """A transfer backend could not start, register memory or move bytes to or from a peer."""
