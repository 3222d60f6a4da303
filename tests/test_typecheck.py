"""tests/typecheck.py's own logic (the check itself is `make typecheck`): the links it makes for
mypy, errors reported at their real paths, and the baseline's count."""

from __future__ import annotations

from typecheck import judge, link_tree


def test_the_links_mirror_package_dir_and_follow_its_changes(tmp_path):
    root, tree = tmp_path / "repo", tmp_path / "repo" / "build" / "typecheck"
    for d in ("tandem", "core", "cache"):
        (root / d).mkdir(parents=True)
        (root / d / "__init__.py").write_text("")
    (root / "tandem" / "cli.py").write_text("")
    links = link_tree({"tandem": "tandem", "tandem.core": "core", "tandem.cache": "cache"}, root, tree)
    assert links == {"build/typecheck/tandem/__init__.py": "tandem/__init__.py",
                     "build/typecheck/tandem/cli.py": "tandem/cli.py",
                     "build/typecheck/tandem/core/": "core/", "build/typecheck/tandem/cache/": "cache/"}
    assert (tree / "tandem" / "core" / "__init__.py").is_file()
    link_tree({"tandem": "tandem", "tandem.core": "core"}, root, tree)      # cache/ left package-dir
    assert sorted(p.name for p in (tree / "tandem").iterdir()) == ["__init__.py", "cli.py", "core"]


def test_errors_are_judged_at_their_real_paths_against_the_baseline():
    links = {"build/typecheck/tandem/core/": "core/", "build/typecheck/tandem/engine/": "engine/",
             "build/typecheck/tandem/cli.py": "tandem/cli.py"}
    out = ("build/typecheck/tandem/core/types.py:3: error: Bad  [misc]\n"
           "build/typecheck/tandem/core/types.py:3: note: See this\n"
           "build/typecheck/tandem/engine/a.py:1: error: Old  [misc]\n"
           "build/typecheck/tandem/engine/b.py:2:5: error: Old too  [misc]\n"
           "build/typecheck/tandem/cli.py:9: error: Also  [misc]\n"
           "Found 4 errors in 4 files (checked 3 source files)\n")
    v = judge(out, links, {"engine/": 1})
    assert v.errors == 2 and v.counted == {"engine/": 2}
    assert v.shown == ["core/types.py:3: error: Bad  [misc]", "core/types.py:3: note: See this",
                       "tandem/cli.py:9: error: Also  [misc]"]
    assert len(judge(out, links, {"engine/": 1}, show_baselined=True).shown) == 5
