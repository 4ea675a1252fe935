"""Sandbox images: SWE-bench's naming, the recipe hashes, the offline base image (built once a session), and
how a task's image is picked. Task images built from install recipes: test_task_env.py.

Pulling an official SWE-bench image needs Docker Hub, so that test runs only where
SEAMLESSFLOW_DOCKER_PULL=1 says pulling works.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from swebench_env.environments import InstallRecipe, RecipeError, pip_failure, target_from_probe
from swebench_env.images import (
    BASE_IMAGE_ENV,
    BaseImageRecipe,
    ImageUnavailable,
    ensure_base_image,
    ensure_swebench_image,
    swebench_image_name,
    task_image,
    task_image_digest,
)
from swebench_env.sandbox import Sandbox, SandboxConfig
from swebench_env.suite import load_suite

PULL_ENV = "SEAMLESSFLOW_DOCKER_PULL"


def test_swebench_image_name_follows_the_harness():
    name = swebench_image_name("django__django-11099")
    assert name == "swebench/sweb.eval.x86_64.django_1776_django-11099:latest"


def test_swebench_image_name_is_lower_case_with_the_given_arch_and_namespace():
    name = swebench_image_name("Owner__Repo-7", namespace="mirror", arch="arm64", tag="v1")
    assert name == "mirror/sweb.eval.arm64.owner_1776_repo-7:v1"


@pytest.mark.parametrize("instance_id", ["", "a/b", "x:y"])
def test_swebench_image_name_rejects_what_is_not_an_instance_id(instance_id):
    with pytest.raises(ValueError, match="instance_id"):
        swebench_image_name(instance_id)


def test_recipe_hash_is_stable():
    assert BaseImageRecipe().image == BaseImageRecipe().image


def test_recipe_hash_ignores_package_order():
    packages = BaseImageRecipe().packages
    assert BaseImageRecipe(packages=packages[::-1]).digest() == BaseImageRecipe().digest()


def test_recipe_hash_changes_with_the_packages():
    recipe = BaseImageRecipe()
    assert BaseImageRecipe(packages=(*recipe.packages, "curl")).digest() != recipe.digest()


def test_recipe_hash_changes_with_the_suite():
    assert BaseImageRecipe(suite="trixie").digest() != BaseImageRecipe().digest()


@pytest.mark.docker
@pytest.mark.parametrize(
    "command",
    ["python --version", "python3 -m pytest --version", "python3 -m venv --help", "git --version"]
    + ["timeout --version", "ps --version", "patch --version", "bash --version"],
)
def test_base_image_has_the_tools(sandbox_config, command):
    with Sandbox(sandbox_config) as sb:
        assert sb.exec(command, timeout_s=60).exit_code == 0


@pytest.mark.docker
def test_base_image_runs_a_pytest_suite(sandbox_config):
    script = (
        "mkdir -p /tmp/w && cd /tmp/w && printf 'def test_ok():\\n    assert 1\\n' > test_a.py && python -m pytest -q"
    )
    with Sandbox(sandbox_config) as sb:
        assert "1 passed" in sb.exec(script, timeout_s=120).output


@pytest.mark.docker
def test_existing_base_image_is_reused(daemon, base_image):
    before = daemon.images.get(base_image).id
    assert ensure_base_image(client=daemon) == base_image
    assert daemon.images.get(base_image).id == before


@pytest.mark.docker
def test_prebuilt_image_is_taken_from_the_environment(daemon, base_image, monkeypatch):
    monkeypatch.setenv(BASE_IMAGE_ENV, base_image)
    assert ensure_base_image(BaseImageRecipe(suite="no-such-suite"), client=daemon) == base_image


@pytest.mark.docker
def test_missing_prebuilt_image_says_what_to_do(daemon):
    # a registry that refuses at once: the pull fails without waiting on the network
    with pytest.raises(ImageUnavailable, match="could not be pulled"):
        ensure_base_image(image="localhost:9/seamlessflow-absent:0", client=daemon)


@pytest.mark.docker
@pytest.mark.skipif(os.environ.get(PULL_ENV) != "1", reason=f"pulls from Docker Hub; set {PULL_ENV}=1 where it works")
def test_official_swebench_image_is_pulled_and_holds_the_repository(daemon):
    image = ensure_swebench_image("sympy__sympy-20590", client=daemon)
    with Sandbox(SandboxConfig(image=image, memory_mb=4096)) as sb:
        assert sb.exec("git rev-parse HEAD", timeout_s=120, workdir="/testbed").exit_code == 0


def test_task_image_hash_ignores_requirement_order_but_not_commands_order():
    digest = task_image_digest("sha256:1", InstallRecipe(("a", "b"), ("x", "y")), None)
    assert task_image_digest("sha256:1", InstallRecipe(("b", "a"), ("x", "y")), None) == digest
    assert task_image_digest("sha256:1", InstallRecipe(("a", "b"), ("y", "x")), None) != digest


def test_task_image_hash_changes_with_the_base_image_and_the_wheels(tmp_path):
    recipe = InstallRecipe(("tiny",))
    (tmp_path / "tiny-1.0-py3-none-any.whl").write_bytes(b"one")
    first = task_image_digest("sha256:1", recipe, tmp_path)
    assert task_image_digest("sha256:2", recipe, tmp_path) != first
    (tmp_path / "tiny-1.0-py3-none-any.whl").write_bytes(b"two!")
    assert task_image_digest("sha256:1", recipe, tmp_path) != first


def test_target_is_read_from_the_base_images_python():
    target = target_from_probe("cpython 3.11 linux-x86_64 glibc 2.36\n")
    assert (target.python, target.platforms) == ("3.11", ("manylinux_2_36_x86_64", "linux_x86_64"))
    with pytest.raises(RecipeError, match="need CPython"):
        target_from_probe("pypy 3.10 linux-x86_64 glibc 2.36")


def test_a_requirement_pip_cannot_find_names_itself():
    output = "ERROR: Could not find a version ... nope==9\nERROR: No matching distribution found for nope==9\n"
    assert pip_failure(output, "the wheelhouse /w").startswith(
        "requirement 'nope==9' cannot be installed offline: no wheel for it in the wheelhouse /w;"
    )


@pytest.mark.docker
def test_a_task_runs_in_the_image_it_names_and_otherwise_in_the_default(daemon, base_image):
    task = load_suite("held_out")[0]
    assert task_image(task, client=daemon) == base_image
    assert task_image(task, "any/default:1", client=daemon) == "any/default:1"
    named = replace(task, extra={**task.extra, "image": base_image})
    assert task_image(named, "any/default:1", client=daemon) == base_image


@pytest.mark.docker
def test_an_official_record_keeps_its_own_image(daemon, base_image):
    task = replace(load_suite("held_out")[0], repo_path=None, repo="owner/name")
    official = replace(task, extra={"eval_script": "true", "image": base_image})
    assert task_image(official, "any/default:1", client=daemon) == base_image
    with pytest.raises(RecipeError, match="official SWE-bench records run in their own image"):
        task_image(replace(official, extra={**official.extra, "install": {"pip": ["six"]}}), client=daemon)
