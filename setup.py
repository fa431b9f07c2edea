"""Packaging that ``pyproject.toml`` cannot express: the Hydra YAML of the top-level ``conf/``
ships inside the package as ``pprun/conf``, and the tuned MoE kernel settings
(``pprun/layers/moe_configs/*.json``) ship beside their module.

Everything else (metadata, dependencies, the ``pprun`` script) is in ``pyproject.toml``. The
package list is found here rather than with ``[tool.setuptools.packages.find]`` because a
mapped package (``pprun.conf`` -> ``conf/``) has to be listed beside the found ones, and the
two ways cannot be mixed. ``pprun.config.default_conf_dir`` finds the installed copy in a wheel
and the top-level folder in a checkout or an editable install.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["pprun", "pprun.*"]), "pprun.conf"],
    package_dir={"pprun.conf": "conf"},
    package_data={"pprun.conf": ["*.yaml", "**/*.yaml"], "pprun.layers": ["moe_configs/*.json"]},
)
