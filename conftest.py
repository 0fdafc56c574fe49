"""Repository conftest.

precision-suite's pytest plugin is loaded through its `pytest11` entry point (pyproject.toml), the
same way as in any project that installs the package, so it is not registered here a second time.
The repository uses the plugin's defaults: baselines in `baselines/`, charts in `reports/`, rules and
tolerance overrides in `[tool.precision_suite]` of pyproject.toml.
"""

import pytest

# the plugin tests (tests/test_plugin.py, tests/test_hf_llama.py) run inner pytest sessions
pytest_plugins = ["pytester"]


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin("precision_suite"):
        raise pytest.UsageError(
            "precision-suite's pytest plugin is not loaded: install the package "
            "(pip install -e .) so that its pytest11 entry point is registered"
        )
