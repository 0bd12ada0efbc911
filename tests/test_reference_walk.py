"""The walks of make test-slow: each lesson's reference page and lesson 08's README, followed as a learner does
(tests/test_readme_walk.py walks the core path in make test; both targets run in CI)."""
import pytest
from test_readme_walk import in_make_test, walk_and_judge

from walk import pages


@pytest.mark.timeout(1800)  # 45-135 s a page on an idle 2-core machine
@pytest.mark.parametrize("page", [p for p in pages() if not in_make_test(p)])
def test_page(page, tmp_path):
    walk_and_judge(page, tmp_path)
