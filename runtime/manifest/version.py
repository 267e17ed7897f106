"""The package's release version, the one place it is written (pyproject.toml reads it from here).

The builder stamps it into every manifest as builder_version; the runtime compares an engine's stamp with it;
engine-serve's /version reports it."""
__version__ = "0.1.0"
