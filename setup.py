"""mcallreduce: multi-color allreduce for data-parallel training over MPI."""
import re
from pathlib import Path

from setuptools import find_packages, setup

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
    install_requires=["numpy>=1.24", "mpi4py>=4.0"],
    extras_require={
        "torch": ["torch==2.13.0"],
        "data": ["torch==2.13.0", "Pillow>=10", "simplejpeg>=1.7"],
        "dev": ["pytest>=7", "matplotlib>=3.7", "scikit-image", "scikit-learn"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["mcallreduce-bench=mcallreduce.bench.__main__:main"]},
)
