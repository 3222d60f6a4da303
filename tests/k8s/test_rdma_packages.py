"""The RDMA libraries (issue 26) and Mooncake's (libcurl, libnuma: its store and master link them):
`make setup` and both images install the same packages."""

from __future__ import annotations

import re

from k8s_support import ROOT

PACKAGES = {"libibverbs1", "librdmacm1", "ibverbs-providers"}
MOONCAKE = {"libcurl4", "libnuma1"}


def test_make_setup_installs_the_rdma_packages():
    text = (ROOT / "Makefile").read_text()
    m = re.search(r"^RDMA_PACKAGES\s*:=\s*(.*)$", text, re.M)
    assert m and set(m.group(1).split()) == PACKAGES
    m = re.search(r"^MOONCAKE_PACKAGES\s*:=\s*(.*)$", text, re.M)
    assert m and set(m.group(1).split()) == MOONCAKE
    assert re.search(r"system-packages\.sh \$\(RDMA_PACKAGES\) \$\(MOONCAKE_PACKAGES\)", text)
    assert re.search(r"^setup:.*\bsystem-packages\b", text, re.M)


def test_both_images_install_the_rdma_packages():
    for image in ("cpu", "gpu"):
        text = (ROOT / "docker" / f"Dockerfile.{image}").read_text()
        installs = " ".join(re.findall(r"apt-get install[^&]*", text.replace("\\\n", " ")))
        assert PACKAGES | MOONCAKE <= set(installs.split()), image
