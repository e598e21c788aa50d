"""The repository's scripts: the launcher's shell entry points, bootstrap, package sets, benchmarks, the code map."""
