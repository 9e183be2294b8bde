"""The package's version: one leaf module, which the server imports without the client package's front."""

__version__ = "0.1.0"
