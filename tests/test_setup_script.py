"""scripts/setup_env.sh installs every command that the package and the other scripts run."""
import re
from pathlib import Path

from mcallreduce.bench.netns import TOOLS as CLUSTER_TOOLS
from mcallreduce.data.throttle import LOOP_DISK_TOOLS

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
COMMAND = r"command -v ([\w.+-]+)"


def setup_checks() -> dict[str, set[str]]:
    """command -> the Debian packages that setup_env.sh installs when it is missing."""
    checks = {}
    for line in (SCRIPTS / "setup_env.sh").read_text().splitlines():
        installs = re.search(r"\|\| need\+=\(([^)]*)\)", line)
        if installs:
            for tool in re.findall(COMMAND, line):
                checks[tool] = set(installs.group(1).split())
    return checks


def test_setup_checks_the_build_tools_and_the_mpi_launcher():
    # the parse itself: a setup line that the pattern misses would pass the tests below vacuously
    assert {"mpicc", "mpirun", "cc", "g++", "cmake"} <= set(setup_checks())


def test_every_command_another_script_requires_is_installed_by_setup():
    checks = setup_checks()
    for script in sorted(SCRIPTS.glob("*.sh")):
        if script.name == "setup_env.sh":
            continue
        required = set(re.findall(COMMAND, script.read_text()))
        assert required <= set(checks), f"{script.name} needs {sorted(required - set(checks))}, which setup_env.sh does not install"


def test_every_command_the_package_runs_is_installed_by_setup():
    checks = setup_checks()
    runs = set(CLUSTER_TOOLS) | set(LOOP_DISK_TOOLS) | {"mpirun"}     # mpirun: mcallreduce.launch
    assert runs <= set(checks), f"setup_env.sh does not install {sorted(runs - set(checks))}"
    for tool, package in CLUSTER_TOOLS.items():   # the cluster's error names the package setup installs
        assert package in checks[tool], (tool, package, checks[tool])
