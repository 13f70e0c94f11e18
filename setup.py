"""mcallreduce: multi-color allreduce for data-parallel training over MPI."""
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.errors import CCompilerError, ExecError, PlatformError

# What a missing compiler, Python.h or jpeglib.h raises while building an extension.
BUILD_ERRORS = (CCompilerError, ExecError, PlatformError, OSError)


class build_py_with_startup_hook(build_py):
    """Also put the Horovod startup hook (a .pth file) at the wheel's root, i.e. site-packages.

    It does nothing unless MCALLREDUCE_ALGORITHM / MCALLREDUCE_HOROVOD ask for the plugin.
    Editable installs get it from scripts/setup_env.sh (python -m mcallreduce.horovod.startup install).
    """

    def run(self):
        super().run()
        self.copy_file(os.path.join("mcallreduce", "horovod", "mcallreduce-horovod.pth"),
                       os.path.join(self.build_lib, "mcallreduce-horovod.pth"))


class optional_build_ext(build_ext):
    """Build the C extensions; the JPEG decoder is optional: without a C compiler, Python
    headers or libjpeg's jpeglib.h (Debian: gcc, python3-dev, libjpeg62-turbo-dev), warn and
    install without it. The MPI executor is not: its build errors stop the install.

    mcallreduce.data._jpegroi decodes only the crop box of a JPEG; without it the data
    transforms decode the whole image with simplejpeg (or Pillow), as before.
    """

    def run(self):
        try:
            super().run()
        except BUILD_ERRORS as exc:   # no compiler at all: raised before any extension
            self.warn(f"C extensions not built ({exc}); mcallreduce works without them")

    def build_extension(self, ext):
        if ext.name == "mcallreduce._executor":
            return super().build_extension(ext)
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as exc:   # CompileError, LinkError, ...: the extension is optional
            self.warn(f"optional extension {ext.name} not built ({exc}); the JPEG decoder falls "
                      f"back to simplejpeg/Pillow (Debian: apt-get install gcc libjpeg62-turbo-dev)")


def mpi_flags():
    """Compile and link flags of the MPI wrapper that mpi4py and Horovod build with
    (MPICC, else mpicc on PATH): Open MPI's --showme, MPICH's -compile_info/-link_info."""
    mpicc = os.environ.get("MPICC") or shutil.which("mpicc")
    if not mpicc:
        return None
    for compile_flag, link_flag in (("--showme:compile", "--showme:link"), ("-compile_info", "-link_info")):
        try:
            cflags = subprocess.run([mpicc, compile_flag], capture_output=True, text=True, check=True).stdout
            ldflags = subprocess.run([mpicc, link_flag], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            continue
        cflags, ldflags = shlex.split(cflags), shlex.split(ldflags)
        if compile_flag == "-compile_info":   # MPICH prints the compiler first
            cflags, ldflags = cflags[1:], ldflags[1:]
        return cflags, ldflags
    return None


def executor_extension():
    """The compiled executor over the system MPI (mcallreduce/native/executor.c). Without an
    MPI the package still installs: schedules, the cost model and the data package need none,
    and the runtime says at first use what is missing."""
    flags = mpi_flags()
    if flags is None:
        print("mcallreduce: no mpicc found; building without the MPI executor")
        return []
    cflags, ldflags = flags
    return [Extension("mcallreduce._executor", ["mcallreduce/native/module.c", "mcallreduce/native/program.c",
                                                "mcallreduce/native/executor.c",
                                                "mcallreduce/native/check.c", "mcallreduce/native/collective.c", "mcallreduce/native/early.c",
                                                "mcallreduce/native/shared_stage.c", "mcallreduce/native/standing.c",
                                                "mcallreduce/native/naps.c"],
                      depends=["mcallreduce/native/kernels.h", "mcallreduce/native/executor.h"],
                      extra_compile_args=cflags + ["-O3", "-std=c11"], extra_link_args=ldflags)]


here = Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"', (here / "mcallreduce" / "__init__.py").read_text()).group(1)

setup(
    name="mcallreduce",
    version=version,
    description="Multi-color (multi-tree) allreduce over MPI for data-parallel training",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=find_packages(include=["mcallreduce", "mcallreduce.*"]),
    package_data={"mcallreduce": ["tuning-measured.json"], "mcallreduce.sim": ["calibration.json"],
                  "mcallreduce.horovod": ["mcallreduce-horovod.pth"]},
    ext_modules=executor_extension() + [
        Extension("mcallreduce.data._jpegroi", ["mcallreduce/data/_jpegroi.c"], libraries=["jpeg"])],
    cmdclass={"build_py": build_py_with_startup_hook, "build_ext": optional_build_ext},
    install_requires=["numpy>=1.24", "mpi4py>=4.0"],
    extras_require={
        "torch": ["torch==2.13.0"],
        "horovod": ["horovod==0.28.1"],  # build it with scripts/build_horovod.sh (needs a C++17 patch)
        "data": ["torch==2.13.0", "Pillow>=10", "simplejpeg>=1.7", "tqdm>=4.60"],
        "dev": ["pytest>=7", "matplotlib>=3.7", "scikit-image", "scikit-learn"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["mcallreduce-bench=mcallreduce.bench.__main__:main"]},
)
