"""The test suite: a package, so that test modules and tests/helpers import by their package name (rank
processes unpickle test functions by module name; pyproject.toml puts the repository root on the path)."""
