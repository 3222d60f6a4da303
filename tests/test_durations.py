"""tests/durations.py: module seconds from pytest's JUnit XML, and two runs compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import durations

XML = """<?xml version="1.0"?><testsuites><testsuite name="pytest">
<testcase classname="tests.cluster.test_a" name="t1" time="{a1}"/>
<testcase classname="tests.cluster.test_a" name="t2" time="{a2}"/>
<testcase classname="tests.engine.test_b.TestX" name="t3" time="{b}"/>
</testsuite></testsuites>"""


def test_modules_are_summed_and_two_runs_sort_by_the_seconds_added(tmp_path: Path):
    quiet, busy = tmp_path / "quiet.xml", tmp_path / "busy.xml"
    quiet.write_text(XML.format(a1=10, a2=5, b=2))
    busy.write_text(XML.format(a1=20, a2=10, b=8))
    assert durations.module_seconds(quiet) == {"tests/cluster/test_a.py": 15.0, "tests/engine/test_b.py": 2.0}
    out = subprocess.run([sys.executable, durations.__file__, str(quiet), str(busy)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[1].startswith("tests/cluster/test_a.py") and "+15.0" in lines[1] and "2.00x" in lines[1]
    assert lines[2].startswith("tests/engine/test_b.py") and "4.00x" in lines[2]
    assert "run 1: 17 worker-seconds, run 2: 38 (2.24x)" in out
    bad = subprocess.run([sys.executable, durations.__file__, str(tmp_path / "none.xml")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no such file" in bad.stderr
