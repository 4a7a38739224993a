"""The package version (its own module, so that modules can read it without importing the package)."""

__version__ = "0.1.0"
