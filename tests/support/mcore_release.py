"""The installed megatron-core release, read from its package metadata without importing it:
collecting the tests imports no megatron-core (tests/conftest.py's no_mcore check needs that;
tests/recipes/test_stack.py checks it is the imported release)."""

from importlib import metadata

from packaging.version import Version

MCORE_RELEASE = Version(metadata.version("megatron-core"))
