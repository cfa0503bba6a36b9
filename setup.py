"""Package discovery for the two source roots.

Shared code in libs/llmgw imports as ``llmgw``; each service in services/<name>
imports as ``llmgw.<name>``. setuptools needs every subpackage listed when
package-dir maps several roots, so they are discovered here rather than kept
by hand in pyproject.toml.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
package_dir = {"llmgw": "libs/llmgw"}
packages = ["llmgw"] + [f"llmgw.{p}" for p in find_packages("libs/llmgw")]
for service in sorted((ROOT / "services").iterdir()):
    if not (service / "__init__.py").exists():
        continue
    name = f"llmgw.{service.name}"
    package_dir[name] = f"services/{service.name}"
    packages.append(name)
    packages += [f"{name}.{p}" for p in find_packages(str(service))]

setup(
    package_dir=package_dir,
    packages=packages,
    package_data={"llmgw": ["py.typed"]},
)
