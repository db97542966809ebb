"""The package version, in one place (the package, the CLI and report.json read it)."""

__version__ = "0.1.0"
