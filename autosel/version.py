"""autosel's version, the one place it is written (pyproject.toml reads it; autosel re-exports it), in a module of
its own so that any module can import it without importing the package's public names."""

__version__ = "0.1.0"
