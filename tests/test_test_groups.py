"""The README's test command (`-n 2 --dist loadgroup`) keeps every Ray-starting test on one xdist worker
(tests/conftest.py): xdist turns each test's group mark into a node id suffix, so a grouping hook that runs too
late leaves the Ray tests spread over both workers without failing anything else."""
from __future__ import annotations

import pytest


def test_ray_tests_share_one_xdist_group(request):
    if not (hasattr(request.config, "workerinput") and request.config.getvalue("loadgroup")):   # an xdist worker
        pytest.skip("only under the README's `-n 2 --dist loadgroup`")
    items = request.session.items
    ray_items = [i for i in items if i.get_closest_marker("ray") is not None]
    if not ray_items:
        pytest.skip("no Ray test collected in this run")
    assert all(i.nodeid.endswith("@ray") for i in ray_items), [i.nodeid for i in ray_items][:5]
    assert not request.node.nodeid.endswith("@ray")   # and not every test: this one starts no Ray
