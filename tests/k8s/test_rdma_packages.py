"""The RDMA libraries (issue 26): `make setup` and both images install the same three packages."""

from __future__ import annotations

import re

from k8s_support import ROOT

PACKAGES = {"libibverbs1", "librdmacm1", "ibverbs-providers"}


def test_make_setup_installs_the_rdma_packages():
    text = (ROOT / "Makefile").read_text()
    m = re.search(r"^RDMA_PACKAGES\s*:=\s*(.*)$", text, re.M)
    assert m and set(m.group(1).split()) == PACKAGES
    assert re.search(r"^setup:.*\bsystem-packages\b", text, re.M)


def test_both_images_install_the_rdma_packages():
    for image in ("cpu", "gpu"):
        text = (ROOT / "docker" / f"Dockerfile.{image}").read_text()
        installs = " ".join(re.findall(r"apt-get install[^&]*", text.replace("\\\n", " ")))
        assert PACKAGES <= set(installs.split()), image
