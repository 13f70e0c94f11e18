"""mcallreduce: multi-color allreduce for data-parallel training over MPI."""
import os
import re
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class build_py_with_startup_hook(build_py):
    """Also put the Horovod startup hook (a .pth file) at the wheel's root, i.e. site-packages.

    It does nothing unless MCALLREDUCE_ALGORITHM / MCALLREDUCE_HOROVOD ask for the plugin.
    Editable installs get it from scripts/setup_env.sh (python -m mcallreduce.horovod.startup install).
    """

    def run(self):
        super().run()
        self.copy_file(os.path.join("mcallreduce", "horovod", "mcallreduce-horovod.pth"),
                       os.path.join(self.build_lib, "mcallreduce-horovod.pth"))

here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "mcallreduce" / "__init__.py").read_text()).group(1)

setup(
    name="mcallreduce",
    version=version,
    description="Multi-color (multi-tree) allreduce over MPI for data-parallel training",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["mcallreduce", "mcallreduce.*"]),
    package_data={"mcallreduce.horovod": ["mcallreduce-horovod.pth"]},
    cmdclass={"build_py": build_py_with_startup_hook},
    install_requires=["numpy>=1.24", "mpi4py>=4.0"],
    extras_require={
        "torch": ["torch==2.13.0"],
        "horovod": ["horovod==0.28.1"],  # build it with scripts/build_horovod.sh (needs a C++17 patch)
        "data": ["torch==2.13.0", "Pillow>=10", "simplejpeg>=1.7"],
        "dev": ["pytest>=7", "matplotlib>=3.7", "scikit-image", "scikit-learn"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["mcallreduce-bench=mcallreduce.bench.__main__:main"]},
)
