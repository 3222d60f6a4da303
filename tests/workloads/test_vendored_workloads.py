"""The vendored public workloads: unchanged copies (md5 of the upstream file), documented, and the
defaults that use them stay inside the repository."""

from __future__ import annotations

import hashlib

import pytest

from tandem import workloads

ROOT = workloads.DIR.parent          # the repository root


@pytest.mark.parametrize("name", sorted(workloads.FILES))
def test_file_is_the_upstream_copy(name):
    path = workloads.DIR / name
    assert hashlib.md5(path.read_bytes()).hexdigest() == workloads.FILES[name]


def test_readme_names_every_file_with_its_md5_and_license():
    readme = (workloads.DIR / "README.md").read_text()
    for name, md5 in workloads.FILES.items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{name}`"))
        assert md5 in row and ("Apache-2.0" in row or "CC-BY-4.0" in row), row
    assert (workloads.DIR / "LICENSE-Apache-2.0.txt").read_text().lstrip().startswith("Apache License")


def test_defaults_point_into_the_repository():
    from tandem.loadtest.loadgen.workloads import VLLM_MULTITURN_FILE
    from tandem.sim.replay.simulate import DEFAULT_TRACE

    for path in (DEFAULT_TRACE, VLLM_MULTITURN_FILE):
        assert path.is_file() and ROOT in path.parents
