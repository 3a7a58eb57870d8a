"""docs/code-map.md is what tests/support/code_map.py makes of the tree: a module added, moved or
renamed, or a package left unplaced in the data flow, fails here until the page is made again."""

import os

from code_map import ROOT, page


def test_the_code_map_is_the_trees():
    with open(os.path.join(ROOT, "docs", "code-map.md")) as f:
        written = f.read()
    assert written == page(), ("docs/code-map.md no longer matches the tree: run "
                               ".venv/bin/python tests/support/code_map.py > docs/code-map.md")
